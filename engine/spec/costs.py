"""The start-up cost model the automatic span policy (spec/policy.py) reads: seconds per step by batch and span.

Contract:
- `measure_costs(runner, proposer, spans, max_batch)` times, once at start-up, the target forward of a step
  of b requests at span s (b x s rows) and the draft of b requests, for b over `measured_batches(max_batch)`
  and every s in `spans`, on the very bodies the engine runs: on CUDA the verify graphs (`graphs.VerifyGraphs`;
  its graphs are captured by the measurement, so the start-up also captures the graph set of every span
  variant), the decode graphs for span 1 and the drafter's `DraftGraphs`; on CPU the same padded bodies run
  eagerly. Each body runs padded: every row a one-token sequence on the dummy page
  (`PiecewiseStack.time_padded`), so the figure is the dense work and launches of that row count;
  attention over a real context is not in it (it grows with the context, the dense part does not).
- `CostModel.verify(b, s)` / `draft(b)`: piecewise-linear in b between measured batches (past the last,
  proportional to b); a span that was not measured takes the next longer measured one. Numbers are
  seconds; only their ratios matter to the policy. The table is made monotone (`monotone`: each point the
  least cost measured at this or more rows), which removes a shared machine's timing spikes.
- A proposer without a drafter pass (n-gram, oracle) drafts on the host: its draft cost is 0. A DFlash
  subclass with its own graphs (DFlash2) is timed on the shared DFlash body, eagerly: an approximation
  (its convolutions and selector are not in it), recorded in the model's notes.
- `SPECBENCH_SPEC_COSTS=<file>`: a model saved from an earlier start's `describe()` (the engine's
  `describe()["levers"]["costs"]`) is loaded instead of measured (`load_costs`; a bad file refuses to
  start, naming the variable): a start without the measurement, and a fixed model for tests.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..runner import ModelRunner
    from .proposer import Proposer

log = logging.getLogger("specbench.engine")
REPS = 3


def measured_batches(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself."""
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    return sorted(set(out + [max_batch]))


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0] if x >= 1 else ys[0] * max(x, 0.0)
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    j = bisect.bisect_left(xs, x)
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostModel:
    batches: list[int]
    spans: list[int]
    verify_s: dict[int, list[float]]  # span -> seconds per measured batch
    draft_s: list[float]  # seconds per measured batch (0 without a drafter pass)
    measure_s: float = 0.0  # wall time the measurement took
    source: str = "measured"
    notes: dict = field(default_factory=dict)

    def verify(self, b: int, span: int) -> float:
        s = next((x for x in self.spans if x >= span), self.spans[-1])
        return _interp(self.batches, self.verify_s[s], b)

    def draft(self, b: int) -> float:
        return _interp(self.batches, self.draft_s, b) if b > 0 else 0.0

    def describe(self) -> dict:
        return {"source": self.source, "batches": self.batches, "spans": self.spans,
                "verify_ms": {str(s): [round(v * 1e3, 4) for v in vs] for s, vs in self.verify_s.items()},
                "draft_ms": [round(v * 1e3, 4) for v in self.draft_s], "measure_s": round(self.measure_s, 3),
                **self.notes}


COSTS_ENV = "SPECBENCH_SPEC_COSTS"  # a cost model saved from `CostModel.describe()`, used instead of measuring


def cost_model_from(d: dict, source: str = "file") -> CostModel:
    """A CostModel from its `describe()` form (milliseconds), e.g. one measured on an earlier start."""
    from ..config import ConfigError  # noqa: PLC0415

    try:
        batches = [int(b) for b in d["batches"]]
        verify = {int(s): [float(v) / 1e3 for v in vs] for s, vs in d["verify_ms"].items()}
        draft = [float(v) / 1e3 for v in d["draft_ms"]]
        ok = batches == sorted(set(batches)) and batches[0] >= 1 and len(draft) == len(batches) and verify \
            and all(len(vs) == len(batches) and min(vs) >= 0 for vs in verify.values()) and min(draft) >= 0
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{COSTS_ENV}: {e!r} is invalid: expected CostModel.describe() JSON") from None
    if not ok:
        raise ConfigError(f"{COSTS_ENV}: invalid cost model: expected ascending batches >= 1 and one cost >= 0 per "
                          "batch for every span and for the draft")
    return CostModel(batches, sorted(verify), verify, draft, 0.0, source)


def load_costs(path: str) -> CostModel:
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from ..config import ConfigError  # noqa: PLC0415

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{COSTS_ENV}={path!r} is invalid: expected a cost-model JSON file")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{COSTS_ENV}={path!r} is invalid: {e}") from None
    return cost_model_from(d, source=f"file:{path}")


def _draft_stack(proposer: Proposer | None, runner: ModelRunner):
    """The drafter's padded body, or None for a host-side proposer: the proposer's own graphs when it runs
    them (built here as its first draft would build them, so the capture happens at start-up), else an
    eager copy used for timing only."""
    from .dflash import DFlashProposer  # noqa: PLC0415  (the drafter's code only when it runs)
    from .dflash_graphs import DraftGraphs  # noqa: PLC0415

    if not isinstance(proposer, DFlashProposer):
        return None
    if hasattr(proposer, "graphs2"):  # DFlash2: its own padded body (convolutions, the walk in the tail)
        from .dflash2_graphs import DraftGraphs2  # noqa: PLC0415

        g2 = proposer.draft_graphs()
        return (g2 or DraftGraphs2(proposer, capture=False)).stack  # type: ignore[arg-type]
    if type(proposer) is not DFlashProposer:  # another subclass: time the shared DFlash body eagerly
        return DraftGraphs(proposer, capture=False).stack  # (an approximation)
    return (proposer.draft_graphs() or DraftGraphs(proposer, capture=False)).stack


def measure_costs(runner: ModelRunner, proposer: Proposer | None, spans: tuple[int, ...], max_batch: int,
                  reps: int = REPS) -> CostModel:
    t0 = time.perf_counter()
    tap = tuple(proposer.tap_layers) if proposer is not None else ()
    batches = measured_batches(max_batch)
    vg = runner.verify_graphs_for(tap)
    dg = runner.decode_graphs(tap) if runner.use_graph_runner else None
    geom = (runner.dummy_slot, runner.dummy_page, runner.pool.page_size)
    verify: dict[int, list[float]] = {}
    for s in sorted(set(spans)):
        row: list[float] = []
        for b in batches:
            if s == 1 and dg is not None and dg.bucket(b) is not None:
                row.append(dg.time_padded(dg.bucket(b) or b, reps))
            else:
                rows = b * s
                row.append(vg.stack.time_padded(rows, *geom, causal=True, reps=reps, quantum=s) if rows <= vg.stack.max_rows
                           else float("nan"))
        verify[s] = _fill_nan(batches, row)
    stack = _draft_stack(proposer, runner)
    if stack is None:
        draft = [0.0] * len(batches)
    else:
        blk = int(getattr(proposer, "block", 0) or 1)  # a dflash proposer's block size B (rows per draft)
        draft = _fill_nan(batches, [stack.time_padded(b * blk, *geom, causal=False, reps=reps, quantum=blk)
                                    if b * blk <= stack.max_rows else float("nan") for b in batches])
    verify, draft = monotone(verify), monotone({0: draft})[0]
    kind = {"DFlashProposer": "dflash", "DFlash2Proposer": "dflash2"}.get(type(proposer).__name__)
    draft_body = "none" if stack is None else ("dflash-eager-approx" if kind is None
                                               else f"{kind}-{'graphs' if stack.capture else 'eager'}")
    cm = CostModel(batches, sorted(verify), verify, draft, time.perf_counter() - t0,
                   notes={"device": str(runner.device), "graphs": vg.mode, "draft_body": draft_body})
    log.info("span cost model: %s", cm.describe())
    return cm


def _fill_nan(xs: list[int], ys: list[float]) -> list[float]:
    """Unmeasurable points (more rows than the body holds) extrapolated in proportion to the batch."""
    out = list(ys)
    last = next((i for i in range(len(out) - 1, -1, -1) if out[i] == out[i]), None)
    for i, y in enumerate(out):
        if y != y:
            out[i] = out[last] * xs[i] / xs[last] if last is not None else 0.0
    return out


def monotone(table: dict[int, list[float]]) -> dict[int, list[float]]:
    """Each point the least measured cost at this or more rows (a longer span, a larger batch): a step never
    gets cheaper with more rows, so a high point is timing noise (another process on the machine)."""
    spans = sorted(table)
    out = {s: list(table[s]) for s in spans}
    for i in range(len(spans) - 1, -1, -1):
        row = out[spans[i]]
        for j in range(len(row) - 2, -1, -1):
            row[j] = min(row[j], row[j + 1])
        if i + 1 < len(spans):
            nxt = out[spans[i + 1]]
            out[spans[i]] = [min(a, b) for a, b in zip(row, nxt, strict=True)]
    return out
