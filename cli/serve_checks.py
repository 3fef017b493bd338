"""`specbench serve`'s start-up checks that run before torch and the engine are imported.

Contract: `check_dirs(model, draft)` returns the first problem with the model or drafter directory as one
line naming the option (missing, not a directory, no or unreadable config.json / tokenizer.json), or None;
it reads two small JSON files and imports nothing heavy, so a wrong path fails in well under 2 s instead
of after the engine's imports. Exit codes of `specbench serve` (docs/server.md): 0 a clean shutdown
(SIGTERM / SIGINT), 2 a bad option, model directory or configuration, 3 the address cannot be bound (port
in use, no permission, not an address of this machine), 1 anything unexpected.
"""

from __future__ import annotations

import json
from pathlib import Path

EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_BIND = 0, 1, 2, 3


def _json_object(f: Path) -> str | None:
    try:
        v = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot be read ({e})"
    except json.JSONDecodeError as e:
        return f"is not valid JSON ({e})"
    return None if isinstance(v, dict) else f"is not a JSON object (got {type(v).__name__})"


def check_dir(flag: str, path: str, needs: tuple[str, ...]) -> str | None:
    d = Path(path)
    if not d.exists():
        return f"{flag}={path!r} is invalid: no such directory"
    if not d.is_dir():
        return f"{flag}={path!r} is invalid: not a directory (expected a model directory with {', '.join(needs)})"
    for name in needs:
        f = d / name
        if not f.is_file():
            return f"{flag}={path!r} is invalid: {name} is missing (expected a model directory with {', '.join(needs)})"
        if name.endswith(".json") and name != "tokenizer.json":
            bad = _json_object(f)
            if bad:
                return f"{flag}={path!r} is invalid: {name} {bad}"
    return None


def check_dirs(model: str, draft: str | None) -> str | None:
    return check_dir("--model", model, ("config.json", "tokenizer.json")) or (
        check_dir("--draft", draft, ("config.json",)) if draft else None)
