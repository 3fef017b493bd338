"""Batch invariance and the divergence-rate gate: does an engine's greedy output depend on its batch?

Contract:
- `run_level(adapter, prompts, max_tokens, level, name)` sends every prompt greedily (no logprobs, the
  requests a user would send) with `level` requests in flight: level 1 in prompt order, other levels in
  reverse order, so a prompt meets other neighbours and other batch shapes. Around it the adapter's
  /metrics are audited (suites/metrics_audit.py) where it has them.
- `compare_outputs(adapter, prompt, ref, other, ...)` compares one output of the engine at level N with
  its own level-1 output. The comparison ends at the first divergence (after it the continuations
  differ). There the engine gives its own distribution for the shared prefix (one fresh greedy token with
  top-k logprobs, else teacher-forced scoring: greedy.recover_dist) and both picks are judged by the regret
  rule (regret.py): each must be within the margin of that distribution's top token; the worse one is the
  divergence's judgement. A length mismatch with equal tokens is a FAIL (past_stop / early_stop, as in the
  greedy gate); an output without token ids, or no distribution at the divergence, is untestable.
- `run_batch_invariance(baseline, candidate, prompts, max_tokens, opts, bopts)`: both arms (the baseline
  = speculation off, the candidate = speculation on) at every level of `bopts.levels` (level 1 is the
  reference and always runs first). One gate per arm and level > 1, "batch cN spec-off" / "batch cN
  spec-on", with per-prompt checks, the run checks of greedy.finish_run and the metrics audit of both
  runs (level 1 and N) as a check "server-metrics" (skipped where the engine publishes none). Then the
  gate "batch-rate": the pooled spec-on batch divergences against the pooled spec-off ones by the
  divergence-rate test (rate.py); this is what catches a speculating path that flips more often under
  batching than plain decoding does, flip by flip benign. The spec-off gates report the engine's own
  batch variance; they fail only on the regret rule (a non-tie flip with speculation off is a bug too).
- `run_rate_gate(baseline, prompts, max_tokens, opts, bopts, tested)`: the gate "divergence-rate" of
  the lossless run: the spec-on vs spec-off divergences of the gates in `tested` (greedy, concurrent),
  every divergence an event and every compared token exposure (re-anchored continuations included),
  against the noise baseline measured on the same prompts: the baseline engine at level 1 vs the
  baseline at each other level (up to the number of prompts). Its prompts are those noise comparisons.
- The rate gates are `RateGateRun`s: a GateRun whose rate test adds a check ("divergence-rate", failed
  when p <= alpha) and, when underpowered, a missing item (CANNOT TEST). docs/lossless.md states the
  rules and their statistics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, counters_delta
from specbench.harness.verdicts import CANNOT_TEST, FAIL

from ..metrics_audit import audit_window, combine_windows, per_step_stream, ready, settle
from .checks import Check
from .greedy import (
    Divergence,
    GateRun,
    GreedyGateOptions,
    LosslessError,
    Prompt,
    PromptCheck,
    cannot_compare,
    engine_k,
    finish_run,
    recover_dist,
    resolve_rule,
    tokenize_prompts,
)
from .prompts import load_prompts
from .rate import ALPHA, DETECT_PER_1K, RateSample, RateTest, rate_test, sample_from_checks
from .regret import first_divergence, judge_pick

LEVELS = (1, 8, 32)
FRACTIONS = (1.0, 0.5, 0.25, 0.75)  # mixed prompt lengths: each prompt cut to this share of its tokens
MIN_PROMPT_TOKENS = 4


@dataclass(frozen=True)
class BatchOptions:
    levels: tuple[int, ...] = LEVELS
    num_prompts: int | None = None  # batch-invariance prompts (default: the largest level)
    alpha: float = ALPHA
    detect_per_1k: float = DETECT_PER_1K

    def __post_init__(self) -> None:
        if not self.levels or any(not isinstance(x, int) or x < 1 for x in self.levels):
            raise LosslessError(f"--batch-levels {','.join(map(str, self.levels))!r} is invalid: expected "
                                "integers >= 1, e.g. 1,8,32")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise LosslessError(f"--batch-prompts {self.num_prompts!r} is invalid: expected an integer >= 1")
        if not 0 < self.alpha < 1:
            raise LosslessError(f"--rate-alpha {self.alpha!r} is invalid: expected 0 < alpha < 1")
        if not self.detect_per_1k > 0:
            raise LosslessError(f"--rate-detect {self.detect_per_1k!r} is invalid: expected > 0 per 1,000 tokens")

    @property
    def others(self) -> list[int]:
        return sorted({x for x in self.levels if x > 1})

    @property
    def prompts_needed(self) -> int:
        return self.num_prompts or max(self.levels)


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        out = ()
    if not out or any(x < 1 for x in out):
        raise LosslessError(f"--batch-levels {text!r} is invalid: expected a comma list of integers >= 1, e.g. 1,8,32")
    return out


@dataclass
class RateGateRun(GateRun):
    """A gate judged (also) by the divergence-rate test: FAIL when p <= alpha, CANNOT TEST when underpowered."""

    rate: RateTest | None = None
    samples: dict = field(default_factory=dict)  # label -> RateSample, for the report

    @property
    def missing(self) -> list[str]:
        out = [m for m in super().missing if not (self.rate is not None and m == "no prompt was tested")]
        if self.rate is not None and self.rate.verdict == CANNOT_TEST and self.rate.missing:
            out.append(self.rate.missing)
        return out

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["rate"] = self.rate.to_dict() if self.rate is not None else None
        d["samples"] = {k: v.to_dict() for k, v in self.samples.items()}
        return d


def mixed_lengths(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    """n prompts (cycled when fewer are given), prompt i cut to FRACTIONS[i % 4] of its tokens (>= 4)."""
    if not prompts:
        raise LosslessError("the prompt set is empty")
    out = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        f = FRACTIONS[i % len(FRACTIONS)]
        keep = len(p.ids) if f >= 1.0 else max(min(MIN_PROMPT_TOKENS, len(p.ids)), round(len(p.ids) * f))
        pid = p.pid if i < len(prompts) else f"{p.pid}#{i // len(prompts)}"
        out.append(Prompt(f"{pid}@{keep}" if keep < len(p.ids) else pid, list(p.ids[-keep:] if f < 1.0 else p.ids),
                          p.text))
    return out


async def load_batch_prompts(baseline: EngineAdapter, candidate: EngineAdapter, dataset: str, n: int,
                             max_chars: int | None = 1000) -> list[Prompt]:
    """The batch-invariance prompt set: the first n prompts of `dataset`, tokenized once (the baseline's
    tokenizer, as every gate), cut to mixed lengths."""
    prompts, _ = await tokenize_prompts(baseline, candidate, load_prompts(dataset, n, max_chars))
    return mixed_lengths(prompts, n)


@dataclass
class LevelRun:
    level: int
    results: list[GenResult]  # in prompt order
    audit: dict
    delta: dict | None
    wall_s: float


async def run_level(adapter: EngineAdapter, prompts: Sequence[Prompt], max_tokens: int, level: int, name: str
                    ) -> LevelRun:
    order = list(range(len(prompts))) if level == 1 else list(reversed(range(len(prompts))))
    reqs = [GenRequest(prompt=list(prompts[i].ids), max_tokens=max_tokens, temperature=0.0,
                       rid=f"{name}-c{level}-{i}", prompt_cache=False) for i in order]
    t0 = time.perf_counter()
    await ready(adapter)
    before_m = await settle(adapter)  # idle first (suites/metrics_audit.py)
    before = await adapter.spec_counters()
    got = await adapter.generate(reqs, concurrency=level)
    desc = adapter.describe()
    k = engine_k(adapter)
    after_m = await settle(adapter, before_m, got, k=k, per_step=per_step_stream(desc)) if before_m is not None \
        else None  # until the server has published what the client received
    after = await adapter.spec_counters()
    by_pos = {i: r for i, r in zip(order, got, strict=True)}
    results = [by_pos[i] for i in range(len(prompts))]
    audit = audit_window(before_m, after_m, got, k=k, per_step=per_step_stream(desc), label=f"{name} c{level}")
    return LevelRun(level, results, audit, counters_delta(before, after), time.perf_counter() - t0)


async def compare_outputs(adapter: EngineAdapter, prompt: Prompt, ref: GenResult, other: GenResult, max_tokens: int,
                          opts: GreedyGateOptions, level: int) -> PromptCheck:
    """The engine's output at `level` against its own level-1 output (module docstring)."""
    pc = PromptCheck(prompt.pid, len(prompt.ids), max_tokens, spec=other.spec)
    if cannot_compare(pc, (("c1", ref), (f"c{level}", other))):
        return pc
    a, b = list(ref.output_ids or []), list(other.output_ids or [])
    pc.candidate_tokens = len(b)
    i = first_divergence(b, a)
    if i is None:
        pc.tokens_compared = len(b)
        return pc
    if i >= len(a):
        pc.tokens_compared = i + 1
        pc.divergences.append(Divergence(i, "past_stop", b[i], None, 0))
        pc.status, pc.reason = "fail", f"c1 stopped at position {i}; c{level} emitted token {b[i]} past it"
        return pc
    if i >= len(b):
        pc.tokens_compared = i
        pc.divergences.append(Divergence(i, "early_stop", None, a[i], 0))
        pc.status = "fail"
        pc.reason = f"c{level} stopped at position {i} (finish_reason={other.finish_reason}); c1 continued with {a[i]}"
        return pc
    pc.tokens_compared = i + 1
    pc.complete = i + 1 >= len(b)
    pick, ref_tok = b[i], a[i]
    dist, source, note = await recover_dist(adapter, list(prompt.ids) + b[:i], pick, opts.top_k)
    if not dist:
        pc.divergences.append(Divergence(i, "token", pick, ref_tok, 0, None, dist_source="none"))
        pc.status, pc.complete = "untestable", False
        pc.missing = "logprobs at the divergence (a one-token generation or teacher-forced scoring)"
        pc.reason = f"{CANNOT_TEST} at position {i} (c{level} {pick} vs c1 {ref_tok}): {note}"
        return pc
    jo, jr = judge_pick(pick, dist, opts.tol), judge_pick(ref_tok, dist, opts.tol)
    worse = sorted((jo, jr), key=lambda j: (j.ok, -(j.regret_or_bound or 0.0)))[0]
    pc.divergences.append(Divergence(i, "token", pick, ref_tok, 0, worse, dist_source=source))

    def reg(j) -> str:
        v = j.regret if j.regret is not None else j.lower_bound
        return f"{'>= ' if j.regret is None else ''}{v:.3f}"

    pc.reason = (f"position {i}: c1 picked {ref_tok} (regret {reg(jr)}), c{level} picked {pick} (regret {reg(jo)}) "
                 f"under the engine's own distribution there ({source})")
    if not pc.complete:
        pc.reason += f"; tokens {i + 1}..{len(b) - 1} not compared (the continuations differ)"
    pc.status = "flip" if worse.ok else "fail"
    return pc


def _metrics_check(windows: Sequence[dict]) -> Check:
    c = combine_windows(windows)
    if c["verdict"] == CANNOT_TEST:
        return Check("server-metrics", True, "; ".join(c["missing"]) or "no metrics", skipped=True)
    detail = "; ".join(c["problems"]) if c["problems"] else (
        f"{c['windows']} run(s) audited: " + ", ".join(c["checks"]) + " agree with the client")
    if c["missing"] and not c["problems"]:
        detail += "; not checked: " + "; ".join(c["missing"])
    return Check("server-metrics", c["verdict"] != FAIL, detail)


async def _compare_level(adapter: EngineAdapter, prompts: Sequence[Prompt], ref: LevelRun, run: LevelRun,
                         max_tokens: int, opts: GreedyGateOptions) -> list[PromptCheck]:
    sem = asyncio.Semaphore(4)

    async def one(p: Prompt, a: GenResult, b: GenResult) -> PromptCheck:
        async with sem:
            return await compare_outputs(adapter, p, a, b, max_tokens, opts, run.level)

    return list(await asyncio.gather(*(one(p, a, b) for p, a, b in
                                       zip(prompts, ref.results, run.results, strict=True))))


async def arm_batch_gates(adapter: EngineAdapter, arm: str, prompts: Sequence[Prompt], max_tokens: int,
                          opts: GreedyGateOptions, levels: Sequence[int], prefix: str = "batch") -> tuple[list[GateRun], RateSample]:
    """One arm at level 1 and at each level > 1, each compared with level 1: the gates and the pooled sample."""
    ref = await run_level(adapter, prompts, max_tokens, 1, f"{prefix}-{arm}")
    gates: list[GateRun] = []
    pooled = RateSample(f"{arm} batch", sources=[])
    for lv in levels:
        t0 = time.perf_counter()
        run = await run_level(adapter, prompts, max_tokens, lv, f"{prefix}-{arm}")
        checks = await _compare_level(adapter, prompts, ref, run, max_tokens, opts)
        g = await finish_run(f"{prefix} c{lv} {arm}", adapter, adapter, checks, run.results, run.delta, opts, t0,
                             engine_k(adapter))
        g.require_spec = False
        g.checks.append(_metrics_check([ref.audit, run.audit]))
        s = sample_from_checks(checks, f"{arm} c{lv} vs c1")
        pooled = pooled.add(s)
        pooled.sources.append(f"c{lv}")
        g.notes.append(f"{len(prompts)} prompts (mixed lengths) at c{lv} (reverse order) vs c1 (prompt order), "
                       f"max_tokens {max_tokens}; {s.describe()}; stats at c{lv}: {g.stats.describe()}")
        g.wall_s += ref.wall_s if not gates else 0.0
        gates.append(g)
    return gates, pooled


def _rate_gate(name: str, test: RateSample, noise: RateSample, bopts: BatchOptions, prompts: list[PromptCheck],
               stats, notes: list[str]) -> RateGateRun:
    rt = rate_test(test, noise, bopts.alpha, bopts.detect_per_1k)
    chk = Check("divergence-rate", rt.verdict != FAIL, rt.detail, skipped=rt.verdict == CANNOT_TEST)
    g = RateGateRun(name, prompts, stats, [chk], 0.0, notes=list(notes), require_spec=False, rate=rt,
                    samples={"test": test, "noise": noise})
    g.notes += [f"test: {test.describe()}", f"noise: {noise.describe()}", f"{rt.verdict}: {rt.detail}"]
    return g


async def run_batch_invariance(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                               max_tokens: int, opts: GreedyGateOptions, bopts: BatchOptions) -> list[GateRun]:
    """The batch-invariance gates of both arms and the batch-rate gate (module docstring)."""
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)  # strict in fp32 here too: each arm is judged against itself
    off, off_s = await arm_batch_gates(baseline, "spec-off", prompts, max_tokens, opts, bopts.others)
    on, on_s = await arm_batch_gates(candidate, "spec-on", prompts, max_tokens, opts, bopts.others)
    rg = _rate_gate("batch-rate", on_s, off_s, bopts, [], on[-1].stats if on else off[-1].stats,
                    [f"spec-on batch variance (pooled over c{', c'.join(map(str, bopts.others))} vs c1) against the "
                     "spec-off batch variance of the same prompts: the excess is speculation's, not batching's"])
    rg.wall_s = time.perf_counter() - t0
    return off + on + [rg]


async def run_rate_gate(baseline: EngineAdapter, prompts: Sequence[Prompt], max_tokens: int, opts: GreedyGateOptions,
                        bopts: BatchOptions, tested: Sequence[GateRun]) -> RateGateRun:
    """The lossless run's divergence-rate gate (module docstring)."""
    t0 = time.perf_counter()
    test = RateSample("spec-on vs spec-off")
    for g in tested:
        test = test.add(sample_from_checks(g.prompts, g.name))
        test.sources.append(g.name)
    levels = sorted({min(lv, len(prompts)) for lv in bopts.others}) or [len(prompts)]
    levels = [lv for lv in levels if lv > 1] or [2]
    gates, noise = await arm_batch_gates(baseline, "spec-off", prompts, max_tokens, opts, levels, prefix="noise")
    noise.label = "spec-off vs spec-off (batch noise)"
    checks = [c for g in gates for c in g.checks]
    noise_checks = [p for g in gates for p in g.prompts]
    rg = _rate_gate("divergence-rate", test, noise, bopts, noise_checks, gates[-1].stats,
                    [f"spec-on vs spec-off divergences of {', '.join(g.name for g in tested)} against the baseline "
                     f"engine's own divergences at c{', c'.join(map(str, levels))} vs c1 on the same prompts "
                     "(the per-prompt rows below are those noise comparisons)"])
    rg.checks = checks + rg.checks
    rg.wall_s = time.perf_counter() - t0
    return rg
