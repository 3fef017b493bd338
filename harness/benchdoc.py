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
