"""`specbench selftest`: proof that the lossless gates have teeth, and no false alarms.

Contract:
- Every greedy fault the candidate's engine names (its "faults" capability, `fault_catalogue()`, family
  "greedy": the speculative-sampling faults belong to the sampled-equivalence gate's self-test, the prefix-cache
  faults to the prefix gate's, the drafter variants to check-draft) is armed on a
  fresh engine like the candidate (`with_faults`), and every gate of registry.SELFTEST_GATES runs against it,
  in its order (`GATE_NAMES`): short-then-long (first, on the fresh engine), greedy, concurrent, mixed,
  stop-in-run, eos-in-run, abort-in-flight, penalties, logit-bias, min-tokens, long-context, headroom, and an
  acceptance-regression gate (mean accepted length on the greedy gate's prompts vs the clean engine's,
  two-sided: a fall or a rise beyond 10% of the excess over 1; `draft_ctx_misaligned` leaves the tokens
  lossless, because verify corrects them, and only acceptance shows it). Every gate applies the tolerance
  `greedy.resolve_rule` decides: strict mode (regret.STRICT_FP32_TOL) for an fp32 candidate, the margin
  otherwise. A gate "catches" a
  fault when it fails (exit 1: FAIL, ERROR, NOT SPECULATING); CANNOT TEST is not a catch. Every fault must be caught by at least one gate.
- The given candidate is clean run 1 (closed afterwards, as is every engine armed from it); the clean
  engine runs the same gates `repeat` times in all, each on a fresh engine; every verdict must be
  PASS (a NOT SPECULATING verdict on the clean engine is a failure too: the bundled drafter speculates).
  Clean run 1 sets the reference acceptance (or `expect_accept_len` when given).
- The baseline (speculation off, the same model) is one engine for the whole self-test, wrapped in a
  cache keyed by the request (prompt ids, max_tokens, logprobs, stop): it is deterministic and clean,
  so re-running it per fault would only cost time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from specbench.harness.adapters.base import EngineAdapter
from specbench.harness.verdicts import ERROR, EXIT_FAIL, FAIL, NOT_SPECULATING, PASS, exit_code

from .cached import CachedAdapter
from .checks import AcceptanceEvidence, check_acceptance
from .greedy import GateRun, GreedyGateOptions, Prompt, resolve_rule, tokenize_prompts
from .prompts import load_prompts
from .registry import SELFTEST_GATES

GATE_NAMES = tuple(s.name for s in SELFTEST_GATES)  # the self-test's gates (its columns), registry.py's order


def greedy_faults(candidate: EngineAdapter) -> dict[str, str]:
    """The candidate engine's faults of the greedy family, which a greedy gate must catch: name -> what it breaks
    (the sampling faults belong to the sampled gate's self-test, the prefix faults to the prefix gate's: every
    greedy gate's request is salted off the prefix cache)."""
    return {k: f.description for k, f in candidate.fault_catalogue().items() if f.family == "greedy"}


@dataclass
class EngineRow:
    label: str
    faults: tuple[str, ...]
    description: str
    verdicts: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    accept_len: float | None = None
    wall_s: float = 0.0

    def caught(self, gate: str) -> bool:
        """The gate failed (FAIL, ERROR, NOT SPECULATING, ...: exit 1). CANNOT TEST is no catch: a gate that
        could not collect evidence proved nothing about the fault."""
        v = self.verdicts.get(gate, PASS)
        return v != "n/a" and exit_code(v) == EXIT_FAIL

    def not_pass(self, gate: str) -> bool:
        return self.verdicts.get(gate, PASS) not in (PASS, "n/a")

    def why(self, gate: str) -> str:
        return self.reasons.get(gate, "")

    @property
    def caught_by(self) -> list[str]:
        return [g for g in GATE_NAMES if self.caught(g)]


@dataclass
class SelftestOutcome:
    engine: dict
    faults: list[EngineRow]
    clean: list[EngineRow]
    num_prompts: int
    max_tokens: int
    margin_tol: float
    reference_accept: float | None
    wall_s: float = 0.0
    gate_names: tuple[str, ...] = GATE_NAMES
    rule: dict = field(default_factory=dict)  # the tolerance the gates applied (greedy.resolve_rule)

    @property
    def missed(self) -> list[str]:
        return [r.label for r in self.faults if not r.caught_by]

    @property
    def false_alarms(self) -> list[str]:
        # On a clean engine every gate must PASS: a CANNOT TEST there is an alarm too (that gate went untested).
        out = []
        for r in self.clean:
            bad = [g for g in self.gate_names if r.not_pass(g)]
            if bad:
                out.append(f"{r.label}: {', '.join(bad)}")
        return out

    @property
    def ok(self) -> bool:
        return not self.missed and not self.false_alarms and bool(self.clean)

    def to_dict(self) -> dict:
        return {"suite": "selftest", "ok": self.ok, "missed": self.missed, "false_alarms": self.false_alarms,
                "engine": self.engine, "num_prompts": self.num_prompts, "max_tokens": self.max_tokens,
                "margin_tol": self.margin_tol, "rule": dict(self.rule), "reference_accept": self.reference_accept,
                "wall_s": self.wall_s,
                "faults": [asdict(r) | {"caught_by": r.caught_by} for r in self.faults],
                "clean": [asdict(r) | {"caught_by": r.caught_by} for r in self.clean]}


def _why(g: GateRun) -> str:
    """The strongest evidence a gate found: the largest regret (or its bound), else the failed check."""
    bad = [p for p in g.prompts if not p.ok]
    judged = [(j.regret_or_bound or 0.0, d, j) for p in bad for d in p.divergences[-1:] if (j := d.judgement)]
    n = f", {len(bad)} requests" if len(bad) > 1 else ""
    if judged:
        r, d, j = max(judged, key=lambda x: x[0])
        kind = "outside top-k" if j.kind == "outside_topk" else "regret"
        if d.rescore_fail:
            kind = "rescore disagrees, regret"
        val = f"{r:.2f}" if r >= 0.01 or r == 0 else f"{r:.1e}"
        return f"{kind} {'>= ' if j.regret is None else ''}{val} @{d.position}{n}"
    if bad:
        last = bad[0].divergences[-1] if bad[0].divergences else None
        if last is not None:
            return last.kind + n
        reason = bad[0].reason
        if "failed: " in reason:  # "candidate request failed: EngineFailure: engine step failed: IndexError: ..."
            err = reason.rsplit("failed: ", 1)[-1]
            head, sep, tail = err.partition(": ")  # "specbench.engine.invariants.InvariantError: step 3: ..."
            err = head.rsplit(".", 1)[-1] + sep + tail
            reason = "request failed (" + err[:90] + ")"
        return reason[:110] + n
    if g.failed_checks:
        return g.failed_checks[0].name
    return "not speculating" if g.verdict == NOT_SPECULATING else g.verdict


async def run_engine(label: str, faults: tuple[str, ...], description: str, baseline: EngineAdapter,
                     candidate: EngineAdapter, prompts: list[Prompt], max_tokens: int, opts: GreedyGateOptions,
                     reference_accept: float | None) -> EngineRow:
    """All gates on one fresh candidate engine; short-then-long first, while nothing has been captured."""
    t0 = time.perf_counter()
    row = EngineRow(label, faults, description)
    stats: AcceptanceEvidence | None = None
    # every gate as (baseline, candidate, prompts, max_tokens, opts): greedy at its default, one request at a time;
    # the acceptance check (kind "check") is judged after them, on the greedy gate's evidence
    runs: dict[str, Callable] = {s.name: s.run for s in SELFTEST_GATES if s.kind != "check"}
    for name, fn in runs.items():
        try:
            g = await fn(baseline, candidate, prompts, max_tokens, opts)
        except Exception as e:  # a gate that crashes on a faulty engine still reports, as ERROR
            row.verdicts[name], row.reasons[name] = ERROR, f"{type(e).__name__}: {e}"[:80]
            continue
        row.verdicts[name] = g.verdict
        if g.verdict != PASS:
            row.reasons[name] = _why(g)
        if name == "greedy":
            stats, row.accept_len = g.stats, g.stats.mean_accept_len
    ref = reference_accept if reference_accept is not None else row.accept_len
    acc = check_acceptance(stats, ref) if stats is not None and stats.num_drafts else None
    ok = acc is not None and acc.ok
    row.verdicts["acceptance"] = PASS if ok else FAIL
    if not ok:
        row.reasons["acceptance"] = f"{row.accept_len or 1.0:.2f} vs {_num(ref)}"
    row.wall_s = time.perf_counter() - t0
    return row


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


async def run_selftest(candidate: EngineAdapter, baseline: EngineAdapter,
                       repeat: int = 5, num_prompts: int = 6, max_tokens: int = 48, dataset: str = "gsm8k",
                       opts: GreedyGateOptions | None = None, faults: list[str] | None = None,
                       expect_accept_len: float | None = None,
                       log: Callable[[str], None] | None = None, progress: Any = None) -> SelftestOutcome:
    """`progress` (cli/progress.py RunProgress, or None) hears each engine as it starts and finishes."""
    if repeat < 1:
        raise ValueError(f"--repeat {repeat} is invalid: expected an integer >= 1")
    say = log or (lambda s: None)
    opts = opts or GreedyGateOptions()
    known = greedy_faults(candidate)
    names = faults if faults is not None else list(known)
    unknown = [f for f in names if f not in known]
    if unknown:
        raise ValueError(f"--faults {','.join(unknown)} unknown: expected any of {', '.join(known)}")
    t0 = time.perf_counter()
    base = CachedAdapter(baseline)
    prompts, _ = await tokenize_prompts(base, candidate, load_prompts(dataset, num_prompts))
    engine = candidate.describe()
    out = SelftestOutcome(engine, [], [], num_prompts, max_tokens, opts.margin_tol, expect_accept_len,
                          rule=resolve_rule(opts, base, candidate).rule_dict())

    if progress is not None:  # the clean engine, each fault, the clean repetitions
        progress.plan(1 + len(names) + (repeat - 1))

    async def one(label: str, fs: tuple[str, ...], desc: str, cand: EngineAdapter | None = None) -> EngineRow:
        if progress is not None:
            progress.phase(label, 1)
        cand = cand or candidate.with_faults(fs)
        try:
            row = await run_engine(label, fs, desc, base, cand, prompts, max_tokens, opts, out.reference_accept)
        finally:
            await cand.aclose()
        if progress is not None:
            progress.advance()
        say(f"[selftest] {label}: caught by {', '.join(row.caught_by) or 'nothing'} ({row.wall_s:.1f} s)")
        return row

    first = await one("clean #1", (), "no fault", candidate)
    out.clean.append(first)
    if out.reference_accept is None:
        out.reference_accept = first.accept_len
    for f in names:
        out.faults.append(await one(f, (f,), known[f]))
    for i in range(2, repeat + 1):
        out.clean.append(await one(f"clean #{i}", (), "no fault"))
    out.wall_s = time.perf_counter() - t0
    return out
