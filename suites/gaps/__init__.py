"""`specbench gaps`: where a GPU sat idle, and which kernels paid for it.

Pipeline: `read_trace(path)` (readers.py: nsys SQLite, nsys stats CSV, Kineto JSON) -> `Trace` of GPU
activities in integer ns -> `analyze(trace, Classifier.build(extra_rules), phases=...)` (analyze.py) ->
`GapsReport` -> `render_text` / `to_json` / `render_markdown` / `plot_idle_by_class` (render.py).
The kernel-class rules are one ordered regex table in classify.py (`RULES`), extendable with
`load_rules(file)`. Every report satisfies `check_invariants`: busy + idle = span, gaps sum to idle,
attributed idle sums to idle, per device. Bad input raises `GapsError`.
"""

from .analyze import BUCKETS, DeviceReport, GapsReport, analyze, check_invariants
from .classify import CLASSES, RULES, Classifier, classify, load_rules
from .readers import FORMATS, read_trace
from .render import plot_idle_by_class, render_markdown, render_text, to_json
from .trace import Activity, GapsError, Trace

__all__ = [
    "BUCKETS", "CLASSES", "FORMATS", "RULES", "Activity", "Classifier", "DeviceReport", "GapsError", "GapsReport",
    "Trace", "analyze", "check_invariants", "classify", "load_rules", "plot_idle_by_class", "read_trace",
    "render_markdown", "render_text", "to_json",
]
