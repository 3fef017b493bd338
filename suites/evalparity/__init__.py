"""Task-level parity: lm-eval tasks run against a baseline and a candidate engine, offline.

Token-level losslessness should imply task-level parity; this suite checks the task level with the
harness users already trust (lm-eval 0.4.x, `local-completions` against an OpenAI-compatible endpoint).

Modules:
- tasks.py    the bundled task YAMLs (harness/data/lm_eval_tasks/), rendered with absolute data paths
- worker.py   one lm-eval run against one endpoint, in its own process (offline switches set first)
- endpoint.py an arm's endpoint: `specbench serve` started on a free loopback port, or a remote URL
- parity.py   the parity rule (pure): scores, stderr, differing answers, verdict
- report.py   markdown and JSON renderings (pure)
- runner.py   the suite: arms in turn, records into the results store, the report

lm-eval is an optional extra (`pip install specbench[eval]`): nothing here imports it at module
import time; only worker.py does, inside its own process.
"""

from __future__ import annotations

from .parity import DIFFERENT, PARITY, ParityRow, compare, overall
from .tasks import TaskError, available_tasks, render_tasks

__all__ = ["DIFFERENT", "PARITY", "ParityRow", "TaskError", "available_tasks", "compare", "overall",
           "render_tasks"]
