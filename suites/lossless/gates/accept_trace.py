"""The acceptance-trace gate (issue 47, item 1): acceptance that must match a replay of the drafter, not only stay
near a recorded mean.

Contract: the candidate runs every prompt at once (greedy, the concurrent gate's staggered max_tokens: batched
drafts, truncated spans at max_tokens, early stops) and reports, per request, the accepted drafts of each verify
step (`spec.accepted_runs`: the bundled engine). The drafter it was given is replayed on each of its own outputs
(harness/replay.py: Hugging Face's target for the tapped states, the drafter's dense path with DFlash2's
convolutions written from their definition; prompt lookup for n-gram): at each step, what that drafter proposes
and how many of the proposals the output accepts.

- Where the candidate reports each step's position and draft count (`spec.step_at`, `spec.step_drafts`: the
  bundled engine), the drafter is replayed at exactly those steps (`replay_steps`), so every step is compared
  whatever chose its draft length (a lever, the automatic policy, max_tokens); a step that is not one of its
  output's (a position past the output or inside the previous step's commit) or that verified more drafts than
  the drafter gives there FAILs in every mode (bookkeeping, not arithmetic).
- Else the replay walks the output itself at the engine's fixed K (`replay_trace`) and the traces are aligned by
  the output position each step starts at (every DFlash step drafts, so the candidate's positions follow from its
  runs; n-gram steps are compared in order, up to the first difference); with a load-aware lever on, the draft
  length is not fixed: CANNOT TEST.

- Exact (the candidate runs fp32, on the CPU or CUDA; `exact=true` of --replay-drafter for an endpoint): every
  step must accept what the replay accepts. A difference where the replay's drafter decided by less than `NEAR_TIE` (its
  logit or selector score gap at a slot the count depends on) is a near-tie two implementations may break either
  way: counted and shown, not failed. Any other difference FAILs with the request, the step, the output position,
  both counts and the margin. The last step of a request that stopped (EOS, a stop) is not compared: a stop
  inside an accepted run cuts the output, not the count.
- Statistical (bf16 and other reduced precisions): per step, the sign of
  candidate - replay; FAIL when the two-sided sign test (scipy's binomtest) gives p < `ALPHA` and the steps' mean
  accepted count moved by more than `MIN_SHIFT` of the replay's.
- A drafter the replay cannot run (a synthetic acceptance, an oracle, a remote engine's own drafter), no
  per-step runs, or no step drafted: CANNOT TEST with that one reason (advisory by default).

An engine that accepts less than its drafter earns (a drafter, position or context bug) or more (a verify rule
that takes what the drafter did not earn) fails here while its output can stay exact. The baseline is not used.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specbench.harness.adapters.base import EngineAdapter, GenResult
from specbench.harness.replay import (
    DFlashReplay,
    NgramReplay,
    Propose,
    ReplayStep,
    draft_block_size,
    replay_steps,
    replay_trace,
)

from ..checks import AcceptanceEvidence, Check, acceptance_evidence
from ..concurrent import staggered
from ..greedy import GreedyGateOptions, LosslessError, prompt_request, resolve_rule
from ..outcomes import GateRun, Prompt, PromptCheck

NEAR_TIE = 1e-3  # the replay drafter's decision margin (logit / selector score) below which a difference is a tie
ALPHA = 1e-3  # the statistical mode's sign test level
MIN_SHIFT = 0.05  # ... and the smallest relative move of the aligned steps' mean accepted count it calls a FAIL
EXACT_DTYPES = ("float32", "fp32")


@dataclass
class TraceCompare:
    """One request's candidate runs against the replay's steps."""

    rid: str
    aligned: int = 0  # steps both traces start at the same output position
    equal: int = 0
    near_ties: list[str] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)  # real differences (exact mode: each a FAIL)
    invalid: list[str] = field(default_factory=list)  # steps that cannot be this output's (a FAIL in every mode)
    signs: list[int] = field(default_factory=list)  # candidate - replay accepted, per aligned step (sign)
    cand_sum: int = 0
    ref_sum: int = 0
    min_margin: float | None = None


def _positions(runs: Sequence[int]) -> list[int]:
    """Each step's start (tokens committed before it), when every step drafted: 1, then + accepted + 1."""
    at, out = 1, []
    for a in runs:
        out.append(at)
        at += a + 1
    return out


def compare(rid: str, runs: Sequence[int], steps: Sequence[ReplayStep], by_position: bool,
            skip_last: bool) -> TraceCompare:
    """Align the candidate's runs with the replay's own walk (module docstring) and compare them."""
    if skip_last:
        runs, steps = list(runs)[:-1], list(steps)[:-1]
    if by_position:
        mine = dict(zip(_positions(runs), runs, strict=True))
        pairs = [(s, mine[s.at]) for s in steps if s.at in mine]
    else:  # in order, up to the first difference (the starts of the rest are unknown)
        pairs = []
        for s, a in zip(steps, runs, strict=False):
            pairs.append((s, a))
            if a != s.accepted:
                break
    return _score(TraceCompare(rid), pairs)


def compare_steps(rid: str, runs: Sequence[int], at: Sequence[int], drafts: Sequence[int],
                  replayed: Sequence[ReplayStep], out_len: int, skip_last: bool) -> TraceCompare:
    """Every step the candidate reports against the drafter replayed at that step (`replay_steps`): the step's
    position must exist and follow the previous step's commit, its draft count must be one the drafter gives,
    and its accepted count must be the replay's."""
    tc = TraceCompare(rid)
    n = len(runs) - (1 if skip_last and runs else 0)
    pairs, end = [], 1
    for i in range(n):
        s, a = replayed[i], runs[i]
        where = f"step {i} at output position {at[i]} ({drafts[i]} drafts, {a} accepted)"
        if s.accepted < 0 or at[i] < end or at[i] + a >= out_len:
            tc.invalid.append(f"{where}: not a step of this output ({out_len} tokens; the previous step committed up "
                              f"to {end})")
            break
        if s.drafted < drafts[i]:
            tc.invalid.append(f"{where}: the drafter gives only {s.drafted} drafts there")
        end = at[i] + a + 1
        pairs.append((s, a))
    return _score(tc, pairs)


def _score(tc: TraceCompare, pairs: Sequence[tuple[ReplayStep, int]]) -> TraceCompare:
    for s, a in pairs:
        tc.aligned += 1
        tc.cand_sum += a
        tc.ref_sum += s.accepted
        tc.signs.append((a > s.accepted) - (a < s.accepted))
        m = s.margin
        if m is not None and m != float("inf"):
            tc.min_margin = m if tc.min_margin is None else min(tc.min_margin, m)
        if a == s.accepted:
            tc.equal += 1
            continue
        where = (f"step at output position {s.at}: the candidate accepted {a} of {s.drafted}, the replayed drafter "
                 f"earns {s.accepted}" + (f" (its smallest deciding margin {m:.2g})" if m is not None else ""))
        (tc.near_ties if m is not None and m < NEAR_TIE else tc.differ).append(where)
    return tc


def _cannot(why: str, opts: GreedyGateOptions, t0: float, notes: Sequence[str] = ()) -> GateRun:
    return GateRun("accept-trace", [], AcceptanceEvidence.not_measured(), [Check("accept-trace", True, why,
                   skipped=True)], time.perf_counter() - t0, notes=list(notes), require_spec=False,
                   rule=opts.rule_dict(), cannot_test=[why])


@dataclass(frozen=True)
class ReplaySpec:
    """`--replay-drafter`: the checkpoints a candidate's drafter was built from, for an engine that does not name
    them (an endpoint). "target=DIR,draft=DIR[,k=N][,exact=true]" (DFlash or DFlash2: Hugging Face checkpoints; k:
    the draft tokens per step, default the drafter's block size - 1) or "ngram=MIN-MAX,k=N" (prompt lookup).
    exact: the candidate runs fp32, so every step must match (default: statistical for an endpoint)."""

    target: str = ""
    draft: str = ""
    ngram: tuple[int, int] | None = None
    k: int | None = None
    exact: bool = False

    @classmethod
    def parse(cls, text: str) -> ReplaySpec:
        head = "--replay-drafter"
        kv: dict[str, str] = {}
        for part in (x.strip() for x in text.split(",") if x.strip()):
            key, eq, val = part.partition("=")
            if not eq or key not in ("target", "draft", "k", "exact", "ngram"):
                raise LosslessError(f"{head} {part!r} is invalid: expected target=DIR, draft=DIR, ngram=MIN-MAX, k=N "
                                    "or exact=true|false, comma separated")
            kv[key] = val
        k = kv.get("k")
        if k is not None and not (k.isdigit() and int(k) >= 1):
            raise LosslessError(f"{head} k={k!r} is invalid: expected an integer >= 1")
        exact = kv.get("exact", "false").lower()
        if exact not in ("true", "false", "1", "0"):
            raise LosslessError(f"{head} exact={kv['exact']!r} is invalid: expected true or false")
        if "ngram" in kv:
            m = re.fullmatch(r"(\d+)-(\d+)", kv["ngram"])
            if not m or not 1 <= int(m[1]) <= int(m[2]):
                raise LosslessError(f"{head} ngram={kv['ngram']!r} is invalid: expected MIN-MAX with 1 <= MIN <= MAX")
            if k is None:
                raise LosslessError(f"{head} ngram needs k=N (the draft tokens per step)")
            return cls(ngram=(int(m[1]), int(m[2])), k=int(k), exact=exact in ("true", "1"))
        for key in ("target", "draft"):
            if not (Path(kv.get(key, "")) / "config.json").is_file():
                raise LosslessError(f"{head} {key}={kv.get(key, '')!r} is invalid: expected a Hugging Face checkpoint "
                                    "directory (with config.json)")
        return cls(kv["target"], kv["draft"], None, int(k) if k else None, exact in ("true", "1"))


def replayer(candidate: EngineAdapter, given: str = "") -> tuple[Callable[[], Propose] | None, bool, str, int]:
    """(a factory of the drafter replay for this candidate, exact?, what it is, k), or (None, False, what the gate
    needs and the candidate lacks, 0). `given`: --replay-drafter (wins over what a local engine names)."""
    if given:
        rs = ReplaySpec.parse(given)
        if rs.ngram is not None:
            lo, hi = rs.ngram
            return (lambda: NgramReplay(lo, hi)), rs.exact, f"n-gram {lo}-{hi}, k {rs.k} (--replay-drafter)", rs.k or 0
        kk = rs.k or draft_block_size(rs.draft) - 1
        return (lambda: DFlashReplay(rs.target, rs.draft, "float32", _device())), rs.exact, \
            f"DFlash drafter {rs.draft}, k {kk}, fp32 replay (--replay-drafter)", kk
    d = candidate.describe() or {}
    raw = d.get("config")
    cfg: dict = raw if isinstance(raw, dict) else {}
    method, k = cfg.get("spec"), cfg.get("k")
    if cfg.get("synthetic_tau") is not None:
        return None, False, "a synthetic acceptance (no drafter to replay)", 0
    if method == "ngram" and isinstance(k, int):
        nmin, nmax = cfg.get("ngram") or (1, 4)
        return (lambda: NgramReplay(int(nmin), int(nmax))), True, f"n-gram {nmin}-{nmax}, k {k}", k
    if method == "dflash" and isinstance(k, int) and cfg.get("draft") and d.get("model"):
        device = "cuda" if str(cfg.get("device", "cpu")).startswith("cuda") else "cpu"
        # fp32 on either device: on one H100 (2026-12-07, tests/gpu/test_accept_trace_gpu.py) CUDA graphs and eager,
        # c8 and c1, DFlash and DFlash2 accepted exactly what the replay earns at every step (252 steps at c8, 282 at
        # c1; 0 near-ties; smallest deciding margin 1.7e-3)
        exact = str(cfg.get("dtype")) in EXACT_DTYPES
        return (lambda: DFlashReplay(str(d["model"]), str(cfg["draft"]), "float32", device)), exact, \
            f"DFlash drafter {cfg['draft']}, k {k}, fp32 replay on {device}", k
    what = ("a drafter the replay can run (DFlash, DFlash2 or n-gram, with its checkpoints), which only a local engine "
            "names (an endpoint: --replay-drafter)")
    if cfg.get("name") != "specbench-local":  # the bundled engine's describe(); an endpoint names no checkpoints
        return None, False, what, 0
    return None, False, what + (": this one does not speculate" if method is None else f": this one runs {method!r}"), 0


def _device() -> str:
    import torch  # noqa: PLC0415

    return "cuda" if torch.cuda.is_available() else "cpu"


def _steps_of(r: GenResult) -> tuple[list[int], list[int]] | None:
    """(each step's position, its draft count) where the candidate reports them for every step, else None."""
    sp = r.spec or {}
    at, dr, runs = sp.get("step_at"), sp.get("step_drafts"), sp.get("accepted_runs")
    if isinstance(at, list) and isinstance(dr, list) and isinstance(runs, list) and len(at) == len(dr) == len(runs):
        return [int(x) for x in at], [int(x) for x in dr]
    return None


def _replay_all(make: Callable[[], Propose], results: Sequence[GenResult], prompts: Sequence[Prompt], k: int,
                mts: Sequence[int], per_step: bool) -> list[list[ReplayStep]]:
    propose = make()
    out = []
    for r, p, m in zip(results, prompts, mts, strict=True):
        pid = list(r.prompt_ids) if r.prompt_ids else list(p.ids)
        ids = list(r.output_ids or [])
        if isinstance(propose, DFlashReplay) and ids:
            propose.taps(pid + ids)  # one target pass per request
        steps = _steps_of(r) if per_step else None
        out.append(replay_steps(propose, pid, ids, list(zip(*steps, strict=True))) if steps is not None
                   else replay_trace(propose, pid, ids, k, m).steps)
    return out


async def accept_trace(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                       max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    make, _, what, _ = replayer(candidate, opts.replay)
    if make is None:
        return _cannot(f"the acceptance trace needs {what}: no request was sent", opts, t0)
    mts = staggered(max_tokens, len(prompts))
    reqs = [prompt_request(p, m, rid=f"trace-{p.pid}") for p, m in zip(prompts, mts, strict=True)]
    results = await candidate.generate(reqs, concurrency=len(reqs))
    out = await judge_traces(candidate, results, prompts, mts, opts)
    out.wall_s = time.perf_counter() - t0
    return out


async def judge_traces(candidate: EngineAdapter, results: Sequence[GenResult], prompts: Sequence[Prompt],
                       mts: Sequence[int], opts: GreedyGateOptions, name: str = "accept-trace") -> GateRun:
    """The candidate's greedy `results` (one per prompt, in order, each asked for `mts[i]` tokens) against its
    drafter's replay (module docstring): the gate's judgement, for any gate's requests (the levers gate's too)."""
    t0 = time.perf_counter()
    make, exact, what, k = replayer(candidate, opts.replay)
    if make is None:
        return _cannot(f"{name} needs {what}", opts, t0)
    failed = [r for r in results if not r.ok]
    if failed and len(failed) == len(results):  # the one true reason: nothing came back to compare
        return _cannot(f"{name}: an answered request: all {len(results)} failed (first: {failed[0].error})", opts, t0)
    runs = [(r.spec or {}).get("accepted_runs") if r.ok else None for r in results]
    if not any(x is not None for x in runs) and any(_totals_of(r) is not None for r in results):
        return await _judge_totals(make, exact, what, k, results, prompts, mts, opts, name, t0)
    if not any(x for x in runs if x is not None):
        why = ("no verify step drafted" if any(x is not None for x in runs)
               else "per-step accepted runs (spec.accepted_runs) or per-request draft and accepted token counts from "
                    "the candidate, which it does not report")
        return _cannot(f"{name}: {why}", opts, t0)
    per_step = all(_steps_of(r) is not None for r, x in zip(results, runs, strict=True) if x is not None)
    cfg = candidate.describe().get("config") or {}
    levers = {n: cfg.get(n) for n in ("gate", "trim", "policy") if cfg.get(n) not in (None, 0, "off")}
    if not per_step and levers:
        return _cannot(f"{name}: each step's position and draft count (spec.step_at, step_drafts), which the "
                       f"candidate does not report, while its load-aware levers {levers} choose the draft length",
                       opts, t0)
    replayed = await asyncio.to_thread(_replay_all, make, results, prompts, k, mts, per_step)
    by_position = "n-gram" not in what  # every DFlash step drafts; an n-gram miss is a plain step
    out = GateRun(name, [], AcceptanceEvidence.not_measured(), require_spec=False, rule=opts.rule_dict())
    comps: list[TraceCompare] = []
    for p, r, run, st, m in zip(prompts, results, runs, replayed, mts, strict=True):
        if run is None:
            out.prompts.append(PromptCheck(f"trace: {p.pid}", len(p.ids), m, status="untestable",
                                           reason=r.error or "no accepted runs reported", missing="accepted_runs"))
            continue
        stopped = r.finish_reason != "length"
        if per_step:
            at_, dr = _steps_of(r)  # type: ignore[misc]
            tc = compare_steps(p.pid, run, at_, dr, st, len(r.output_ids or []), skip_last=stopped)
        else:
            tc = compare(p.pid, run, st, by_position, skip_last=stopped)
        comps.append(tc)
        bad = tc.invalid + (tc.differ if exact else [])
        out.prompts.append(PromptCheck(
            f"trace: {p.pid}", len(p.ids), m, status="fail" if bad else "identical",
            candidate_tokens=len(r.output_ids or []), tokens_compared=len(r.output_ids or []),
            reason="; ".join(bad[:3]),
            spec={"aligned_steps": tc.aligned, "equal": tc.equal, "near_ties": len(tc.near_ties),
                  "accepted": tc.cand_sum, "replay_accepted": tc.ref_sum}))
    aligned = sum(c.aligned for c in comps)
    ties = [f"{c.rid}: {w}" for c in comps for w in c.near_ties]
    margins = [c.min_margin for c in comps if c.min_margin is not None]
    mode = ("every reported step" if per_step else "walked at k " + str(k)) + (", exact" if exact else ", statistical")
    out.notes.append(f"replay: {what}; {mode}; {aligned} steps compared, {sum(c.equal for c in comps)} equal, "
                     f"{len(ties)} near-ties (< {NEAR_TIE:g})"
                     + (f", smallest deciding margin {min(margins):.3g}" if margins else ""))
    out.notes += [f"near-tie: {t}" for t in ties[:5]]
    bad_steps = [c for c in comps if c.invalid]
    if bad_steps:
        out.checks.append(Check(f"{name}: steps", False, f"{len(bad_steps)} of {len(comps)} requests report a step "
                                f"that cannot be their output's; first: {bad_steps[0].rid}: {bad_steps[0].invalid[0]}"))
    if not aligned:
        out.cannot_test.append(f"{name}: no step of the candidate aligned with the replay's")
    elif exact:
        n_bad = sum(bool(c.differ) for c in comps)
        first = next((c for c in comps if c.differ), None)
        out.checks.append(Check(f"{name}: exact", n_bad == 0,
                                f"{aligned} verify steps compared, {sum(len(c.differ) for c in comps)} differ beyond a "
                                f"near-tie in {n_bad} of {len(comps)} requests"
                                + (f"; first: {first.rid}: {first.differ[0]}" if first else "")))
    else:
        out.checks.append(_sign_check(comps, name))
    cs, rs = sum(c.cand_sum for c in comps), sum(c.ref_sum for c in comps)
    out.evidence = {"aligned_steps": aligned, "accepted": cs, "replay_accepted": rs, "near_ties": len(ties),
                    "exact": exact, "per_step": per_step, "min_margin": min(margins) if margins else None}
    out.stats = acceptance_evidence(results, None, opts.min_accept_len)
    out.results = list(results)
    out.wall_s = time.perf_counter() - t0
    return out


def _totals_of(r: GenResult) -> tuple[int, int] | None:
    """(draft tokens, accepted tokens) one request reports (llama.cpp's timings), else None."""
    sp = r.spec or {} if r.ok else {}
    d, a = sp.get("num_draft_tokens"), sp.get("num_accepted_tokens")
    return (int(d), int(a)) if isinstance(d, int) and isinstance(a, int) else None


async def _judge_totals(make: Callable[[], Propose], exact: bool, what: str, k: int, results: Sequence[GenResult],
                        prompts: Sequence[Prompt], mts: Sequence[int], opts: GreedyGateOptions, name: str,
                        t0: float) -> GateRun:
    """An engine that reports per request only its draft and accepted token totals: the replay walks each output at
    k and must draft and accept the same totals (exact: equal, unless the walk passed a near-tie; else the sign test
    over requests)."""
    replayed = await asyncio.to_thread(_replay_all, make, results, prompts, k, mts, False)
    out = GateRun(name, [], AcceptanceEvidence.not_measured(), require_spec=False, rule=opts.rule_dict())
    comps: list[TraceCompare] = []
    for p, r, st, m in zip(prompts, results, replayed, mts, strict=True):
        tot = _totals_of(r)
        if tot is None:
            out.prompts.append(PromptCheck(f"trace: {p.pid}", len(p.ids), m, status="untestable",
                                           reason=r.error or "no draft counts reported", missing="draft counts"))
            continue
        d_c, a_c = tot
        d_r, a_r = sum(s.drafted for s in st), sum(s.accepted for s in st)
        margins = [x for s in st for x in s.margins if x != float("inf")]
        tc = TraceCompare(p.pid, aligned=len(st), equal=len(st) if (d_c, a_c) == (d_r, a_r) else 0,
                          signs=[(a_c > a_r) - (a_c < a_r)], cand_sum=a_c, ref_sum=a_r,
                          min_margin=min(margins) if margins else None)
        if (d_c, a_c) != (d_r, a_r):
            why = (f"the candidate drafted {d_c} tokens and accepted {a_c}; the replayed drafter, walking the same "
                   f"{len(r.output_ids or [])} tokens at k {k}, drafts {d_r} and earns {a_r}")
            (tc.near_ties if tc.min_margin is not None and tc.min_margin < NEAR_TIE else tc.differ).append(why)
        comps.append(tc)
        bad = exact and bool(tc.differ)
        out.prompts.append(PromptCheck(f"trace: {p.pid}", len(p.ids), m, status="fail" if bad else "identical",
                                       candidate_tokens=len(r.output_ids or []),
                                       tokens_compared=len(r.output_ids or []), reason=tc.differ[0] if bad else "",
                                       spec={"drafted": d_c, "accepted": a_c, "replay_drafted": d_r,
                                             "replay_accepted": a_r}))
    n_eq = sum(not c.differ and not c.near_ties for c in comps)
    out.notes.append(f"replay: {what}; per-request totals (the candidate reports no steps), "
                     f"{'exact' if exact else 'statistical'}; {n_eq} of {len(comps)} requests equal, "
                     f"{sum(bool(c.near_ties) for c in comps)} past a near-tie (< {NEAR_TIE:g})")
    if not comps:
        out.cannot_test.append(f"{name}: no request reported its draft counts")
    elif exact:
        bad_c = [c for c in comps if c.differ]
        out.checks.append(Check(f"{name}: exact totals", not bad_c,
                                f"{len(comps)} requests, {len(bad_c)} differ beyond a near-tie"
                                + (f"; first: {bad_c[0].rid}: {bad_c[0].differ[0]}" if bad_c else "")))
    else:
        out.checks.append(_sign_check(comps, name))
    out.evidence = {"requests": len(comps), "equal": n_eq, "accepted": sum(c.cand_sum for c in comps),
                    "replay_accepted": sum(c.ref_sum for c in comps), "exact": exact, "per_step": False,
                    "totals": True}
    out.stats = acceptance_evidence(results, None, opts.min_accept_len)
    out.results = list(results)
    out.wall_s = time.perf_counter() - t0
    return out


def _sign_check(comps: Sequence[TraceCompare], name: str = "accept-trace") -> Check:
    from scipy.stats import binomtest  # noqa: PLC0415

    up = sum(s > 0 for c in comps for s in c.signs)
    down = sum(s < 0 for c in comps for s in c.signs)
    steps = sum(len(c.signs) for c in comps)
    cs, rs = sum(c.cand_sum for c in comps), sum(c.ref_sum for c in comps)
    shift = (cs - rs) / steps / max(rs / steps, 1e-9) if steps else 0.0
    p = binomtest(up, up + down, 0.5).pvalue if up + down else 1.0
    ok = not (p < ALPHA and abs(shift) > MIN_SHIFT)
    return Check(f"{name}: sign test", ok,
                 f"{steps} aligned steps: the candidate accepted more at {up}, fewer at {down}; two-sided sign test "
                 f"p = {p:.3g}; mean accepted {cs / max(steps, 1):.3f} vs replay {rs / max(steps, 1):.3f} "
                 f"({shift:+.1%}; FAIL if p < {ALPHA:g} and |shift| > {MIN_SHIFT:.0%})")
