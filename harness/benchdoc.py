"""The benchmarks' output contract: a human table first, then one JSON document as the last stdout line.

Kept in the harness (not the CLI) so that `python -m specbench.benchmarks.<name>` and `specbench bench-decode`
share it without the benchmarks importing the command-line layer.
"""

from __future__ import annotations

import json
from pathlib import Path


def emit_document(res: dict, out: str | Path | None = None) -> str:
    """Print a benchmark's JSON document as the last stdout line; with `out`, also write it there."""
    doc = json.dumps(res, default=str)
    if out:
        Path(out).write_text(doc + "\n")
    print(doc)
    return doc


def positive_ints(text: str, field: str = "value") -> tuple[int, ...]:
    """A benchmark flag's comma list of integers >= 1 ("1,8,16"); anything else exits naming the flag."""
    try:
        out = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise SystemExit(f"{field}: expected a comma list of integers >= 1 (e.g. 1,8,16), got {text!r}")
    return out
