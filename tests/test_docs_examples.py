"""No example in README.md or docs/ writes into the source tree (issue 48, "doc examples write into the source
tree"): every output path that a fenced example passes to a writing option lies outside the tracked folders
(results/, the run store, is ignored by git; /tmp and ~ are outside the checkout)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WRITES = re.compile(r"(?:^|\s)(?:--report|--out|-o|--merge-into|--json-out|--results|--save-to)[ =]([^\s\\`'\"]+)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _tracked_dirs() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {p.split("/", 1)[0] for p in out.splitlines() if "/" in p}


def _writes(text: str) -> list[str]:
    return [m.group(1) for block in FENCE.findall(text) for m in WRITES.finditer(block)]


def test_the_scan_sees_a_write_into_the_tree():
    doc = "text\n```bash\nspecbench sweep --concurrency 1 --report reports/x.md\nspecbench report R -o /tmp/y.md\n```\n"
    assert _writes(doc) == ["reports/x.md", "/tmp/y.md"]


def test_no_doc_example_writes_into_the_source_tree():
    tracked = _tracked_dirs() - {"results"}
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in _writes(doc.read_text()):
            top = path.lstrip("./").split("/", 1)[0]
            if not path.startswith(("/", "~", "$")) and (top in tracked or (ROOT / path).exists()):
                bad.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not bad, "doc examples that write into the source tree:\n" + "\n".join(bad)
