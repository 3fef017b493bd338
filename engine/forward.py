"""The forward phase: ONE target forward over every span of the step.

`run_forward(plan, runner, proposer, faults)` allocates each span's KV slots (a verify span's
[anchor, d1..dK] lands past the committed length: the speculative reservation that the commit rolls
back), picks the logits rows the accept phase reads, and runs the forward through the fault hook
(`NO_FAULTS`: `ModelRunner.forward` itself). Logits rows per span: a prefill chunk none, or its last row
when it completes the prompt, or all of them with prompt logprobs; a decode span its one row; a verify
span all K + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .faults import Faults
from .runner import ModelRunner
from .scheduler import Span, StepPlan
from .spec.proposer import Proposer


@dataclass
class StepForward:
    logits: torch.Tensor  # fp32 [rows, V]: the rows `rows` names, spans in plan order
    taps: torch.Tensor | None  # the proposer's tapped layer outputs for every token row, or None
    rows: list[tuple[int, int]]  # per span: (its first logits row, row count)


def logit_rows(spans: list[Span]) -> tuple[list[int], list[tuple[int, int]]]:
    """(flat token rows whose logits are needed, per span (first logits row, count))."""
    flat: list[int] = []
    per_span: list[tuple[int, int]] = []
    off = 0
    for s in spans:
        n = len(s.tokens)
        want = s.logit_rows()
        per_span.append((len(flat), len(want)))
        flat += [off + j for j in want]
        off += n
    return flat, per_span


def run_forward(plan: StepPlan, runner: ModelRunner, proposer: Proposer | None, faults: Faults) -> StepForward:
    flat, per_span = logit_rows(plan.spans)
    for s in plan.spans:
        runner.pool.ensure(s.req.rid, s.start + len(s.tokens))
    tap = proposer.tap_layers if proposer is not None else ()
    # deferred drafts (spec/pending.py): the verify runner fills them in on the device
    logits, taps = faults.on_forward(runner, plan.spans, flat, tap, plan.pending)
    return StepForward(logits, taps, per_span)
