"""What a run of tests/foreign leaves behind for `reports/foreign/llamacpp.md` (issue #27).

The llama.cpp tests write, next to the gates' own results runs, one JSONL file of their own records:

    <dir>/foreign.jsonl      one {"kind": ..., ...} per line:
        build     the llama.cpp build used: build.json, cached or fresh, fixture set-up seconds
        models    the GGUF fixtures (models.json)
        server    one per started server: kind, command line (paths and port as placeholders), start seconds
        scenario  one per gate command: name, argv (URLs as server labels), exit code, expected exit
                  code, verdict, the results sub-directory holding its run records
        finding   one per llama.cpp finding: id, title, status ("present" or "changed"), what was
                  observed (numbers measured in this run), the cause where the vendored source shows
                  it, and a minimal reproduction (server kind + request bodies)
    <dir>/<scenario>/<run-id>/   the gate's results run (run.json, gates.jsonl, audit.jsonl, ...)
    <dir>/junit.xml          pytest's own record of the session (outcomes, times)

`dir` is $SPECBENCH_LLAMACPP_RESULTS when set (scripts/foreign-report.sh sets it), else a pytest temp
directory. Records are appended and flushed one line at a time, so a killed session keeps what it wrote.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from specbench import env

ENV = "SPECBENCH_LLAMACPP_RESULTS"
FILE = "foreign.jsonl"
KINDS = ("build", "models", "server", "scenario", "finding")
_lock = threading.Lock()


def results_dir() -> Path | None:
    where = env.get(ENV)
    return Path(where) if where else None


def append(dir: str | Path, kind: str, record: dict[str, Any]) -> dict:
    """Append one record of `kind` to <dir>/foreign.jsonl and return it (with "kind")."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    if "kind" in record:
        raise ValueError("a record's own fields cannot be named 'kind' (it names the record type)")
    rec = {"kind": kind, **record}
    line = json.dumps(rec, default=str, ensure_ascii=False) + "\n"
    Path(dir).mkdir(parents=True, exist_ok=True)
    with _lock, open(Path(dir) / FILE, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
    return rec


def read(dir: str | Path) -> list[dict]:
    """Every complete record of <dir>/foreign.jsonl (a torn last line is skipped)."""
    p = Path(dir) / FILE
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
