"""The sampled equivalence gate: spec-off vs spec-on token distributions, per (prompt, config, position).

Contract:
- For every prompt x sampling config, each arm draws `samples` seeded generations of `positions`
  tokens (ignore_eos; a missing position, e.g. an engine that stopped early, is the category END = -1).
  Seeds are distinct per sample and disjoint between arms (`seed_of`), so the two samples of a cell are
  independent draws. An engine that reports no output ids has its text re-tokenized (`adapter.tokenize`).
  Position 0 comes from prefill; positions >= 1 pass through verify/accept whenever the candidate speculates (an engine only speculates while >= 2 tokens remain), hence max_tokens = P.
- A cell is (prompt, config, position j): the marginal distribution of output token j. Each cell gets a
  permutation test on the maximum studentized frequency difference (stats.py; one shared set of
  relabellings per run), then Benjamini-Hochberg across the comparison's testable cells at q. A cell
  whose pooled sample holds a single token carries no information (its conditional p-value is 1 under
  any alternative) and is excluded from the BH family; it is counted and reported. Unrejected cells
  whose p-value is near the resolution floor 1/(B+1) get extra permutations (up to ceil(2 m / q)) so a
  lone differing cell can still pass BH's q/m threshold.
- The candidate's spec counters are snapshotted around its generation: no drafts -> NOT SPECULATING, no
  accepted draft -> NO DRAFT ACCEPTED (both fail: the accept path was not exercised); an engine without
  counters -> "PASS (speculation unverified)". Any failed request -> INCOMPLETE. Any rejected cell in the
  main comparison or the null (spec vs spec, disjoint seeds) comparison -> FAIL.
- No verdict without evidence: a sample the gate cannot read (no output ids and no tokenizer; an empty
  token list for a non-empty text; no token at all although max_tokens = P with ignore_eos) is
  "untestable" (`Samples.untestable`, never a row of END), and a comparison with zero testable cells is
  no comparison: either gives CANNOT TEST, with what was missing in `GateResult.missing`, never PASS.
- Chat (`opts.endpoint_type == "chat"`, --endpoint-type chat): every request of both arms is the prompt as
  one user message (/v1/chat/completions; the server applies its chat template), the same request on both
  sides. What each arm reports it computed for a prompt (`prompt_ids`, else usage `prompt_tokens`) is
  kept per prompt (`Samples.rendered`); arms (or samples) that rendered one prompt differently are no
  comparison of the same input: CANNOT TEST, naming the prompt (`rendering_problems`). Neither reporting
  anything is stated in `GateResult.notes`, not a verdict.
- `run_gate` never loads engines; the caller passes adapters (the CLI builds them from engine strings).
  Options live in config.py, prompt sets in prompts.py (re-exported here).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from specbench.harness.adapters.base import EngineAdapter, counters_delta
from specbench.harness.verdicts import CANNOT_TEST, exit_code

from . import stats
from .config import (
    DEFAULT_CONFIGS,
    PROMPT_SETS,
    SampledError,
    SampledGateOptions,
    SamplingConfig,
    parse_configs,
)
from .prompts import echo_prompts, load_prompts, make_prompts, request

END = -1
SUITE_VERSION = "1"


ARMS = 3  # baseline, candidate, null candidate
SEED_LIMIT = 1 << 31


def seed_of(seed: int, arm: int, cell: int, sample: int, cells: int, samples: int) -> int:
    """((seed * ARMS + arm) * cells + cell) * samples + sample: distinct per sample, disjoint per arm and per
    --seed, and below 2^31, because engines keep only 32 bits of a seed (torch's CPU generator takes the
    low 32; some servers want an int32), so a layout with wider offsets would repeat streams."""
    return ((seed * ARMS + arm) * cells + cell) * samples + sample


@dataclass
class Samples:
    """tokens[(prompt_idx, config_idx)] -> int array [n, positions] (END where missing)."""

    arm: str
    tokens: dict[tuple[int, int], np.ndarray]
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    spec: dict | None = None  # counters delta over this arm's generation
    untestable: list[str] = field(default_factory=list)  # samples without readable tokens (and why)
    spec_by_config: dict[str, dict | None] = field(default_factory=dict)  # counters delta per sampling config
    # per prompt index: what the engine reported it computed for it (("ids", ids...) or ("len", n)); chat only
    rendered: dict[int, set[tuple]] = field(default_factory=dict)


def _rendered_key(res: Any) -> tuple | None:
    if res.prompt_ids is not None:
        return ("ids", *res.prompt_ids)
    return ("len", res.prompt_tokens) if res.prompt_tokens is not None else None


def _rendered_len(k: tuple) -> int:
    return len(k) - 1 if k[0] == "ids" else int(k[1])


def rendering_problems(prompts: Sequence[tuple[str, str]], *arms: Samples) -> list[str]:
    """Chat prompts rendered differently across samples or arms (ids where reported, else lengths)."""
    out = []
    for pi, (pid, _) in enumerate(prompts):
        per_arm = {a.arm: a.rendered[pi] for a in arms if a.rendered.get(pi)}
        keys: set[tuple] = set().union(*per_arm.values()) if per_arm else set()
        ids = {k[1:] for k in keys if k[0] == "ids"}
        lens = {_rendered_len(k) for k in keys}
        if len(ids) > 1 or len(lens) > 1:
            desc = "; ".join(f"{arm}: {sorted({_rendered_len(k) for k in ks})} tokens" for arm, ks in per_arm.items())
            out.append(f"prompt {pid}: the same chat request was rendered to different prompts ({desc}"
                       + ("" if len(lens) > 1 else ", same lengths, different ids") + "): not the same input")
    return out


def collect(adapter: EngineAdapter, prompts: Sequence[tuple[str, str]], configs: Sequence[SamplingConfig],
            opts: SampledGateOptions, arm: str, arm_index: int,
            on_result: Callable[[Any], None] | None = None) -> Samples:
    cells = len(prompts) * len(configs)
    if seed_of(opts.seed + 1, 0, 0, 0, cells, opts.samples) > SEED_LIMIT:
        raise SampledError(f"--seed {opts.seed} with {cells} prompt x config cells of {opts.samples} samples does not "
                           f"fit below 2^31: expected --seed < {SEED_LIMIT // (ARMS * cells * opts.samples)}")
    # One generation per sampling config, the counters read around each: the report states per config how
    # many verify steps ended on a rejection and how many were fully accepted (a bonus row drawn).
    results, keys, by_config = [], [], {}
    chat = opts.endpoint_type == "chat"
    seconds = 0.0
    spec: dict | None = None
    for ci, c in enumerate(configs):
        reqs = []
        for pi, (pid, text) in enumerate(prompts):
            for si in range(opts.samples):
                s = seed_of(opts.seed, arm_index, pi * len(configs) + ci, si, cells, opts.samples)
                reqs.append(request(text, chat, max_tokens=opts.positions, temperature=c.temperature,
                                    top_p=c.top_p, top_k=c.top_k, seed=s, ignore_eos=True,
                                    rid=f"{arm}-{pid}-{c.name}-{si}", prompt_cache=False))
                keys.append((pi, ci))
        before = adapter.spec_counters_sync()
        t0 = time.perf_counter()
        results += adapter.generate_sync(reqs, concurrency=opts.concurrency, on_result=on_result)
        seconds += time.perf_counter() - t0
        delta = counters_delta(before, adapter.spec_counters_sync())
        by_config[c.name] = delta
        spec = delta if ci == 0 else _add_counters(spec, delta)
    rows: dict[tuple[int, int], list[list[int]]] = {}
    failed: list[str] = []
    untestable: list[str] = []
    retok: dict[str, list[int] | None] = {}
    rendered: dict[int, set[tuple]] = {}
    for key, res in zip(keys, results, strict=True):
        if not res.ok:
            failed.append(f"{res.rid}: {res.error}")
            continue
        if chat and (rk := _rendered_key(res)) is not None:
            rendered.setdefault(key[0], set()).add(rk)
        out = res.output_ids
        how = "output ids"
        if out is None or (res.text and not out):
            # An engine that reports text only: re-tokenize it. Any fixed function of the output keeps the
            # null hypothesis (equal distributions), so the test stays valid; positions are then those of
            # the re-tokenized text.
            if res.text not in retok:
                retok[res.text] = adapter.tokenize_sync(res.text)
            out, how = retok[res.text], "re-tokenized text"
            if out is not None and res.text and not out:
                out = None  # an empty token list for a non-empty text is no sample
        if out is None:
            untestable.append(f"{res.rid}: output token ids (neither reported nor re-tokenizable)")
            continue
        if not out:
            untestable.append(f"{res.rid}: no token returned ({how}; max_tokens {opts.positions}, ignore_eos)")
            continue
        ids = list(out[:opts.positions])
        rows.setdefault(key, []).append(ids + [END] * (opts.positions - len(ids)))
    tokens = {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}
    return Samples(arm, tokens, failed, seconds, spec, untestable, by_config, rendered)


@dataclass
class Cell:
    prompt: str
    config: str
    position: int
    n_a: int
    n_b: int
    support: int
    stat: float
    p_value: float
    permutations: int
    tv: float
    mde_lone: float  # min detectable TV, 80% power, this cell alone differing (level q / m)
    mde_all: float  # the same when every cell differs (level about q)
    q_value: float = 1.0
    testable: bool = True
    rejected: bool = False


@dataclass
class Comparison:
    name: str  # "spec" (baseline vs candidate) or "null" (candidate vs candidate)
    arms: tuple[str, str]
    cells: list[Cell]
    seconds: float = 0.0

    @property
    def testable(self) -> int:
        return sum(c.testable for c in self.cells)

    @property
    def rejected(self) -> list[Cell]:
        return [c for c in self.cells if c.rejected]


def compare(name: str, a: Samples, b: Samples, prompts: Sequence[tuple[str, str]],
            configs: Sequence[SamplingConfig], opts: SampledGateOptions) -> Comparison:
    t0 = time.perf_counter()
    perms: dict[tuple[int, int], stats.Permuter] = {}
    cells: list[Cell] = []
    data: list[tuple[np.ndarray, np.ndarray, stats.PermResult, stats.Permuter]] = []
    for key in sorted(set(a.tokens) & set(b.tokens)):
        ta, tb = a.tokens[key], b.tokens[key]
        na, nb = len(ta), len(tb)
        if (na, nb) not in perms:
            perms[(na, nb)] = stats.Permuter(na, nb, opts.permutations, seed=opts.seed + 7919 * len(perms))
        perm = perms[(na, nb)]
        for j in range(opts.positions):
            r = perm.test(ta[:, j], tb[:, j])
            cells.append(Cell(prompts[key[0]][0], configs[key[1]].name, j, na, nb, r.support, r.stat,
                              r.p_value, r.permutations, stats.tv_distance(ta[:, j], tb[:, j]), math.inf,
                              math.inf, testable=r.support > 1))
            data.append((ta[:, j], tb[:, j], r, perm))
    idx = [i for i, c in enumerate(cells) if c.testable]
    m = max(len(idx), 1)
    if opts.refine and idx:
        rej = stats.benjamini_hochberg([cells[i].p_value for i in idx], opts.q)
        upto = math.ceil(2 * m / opts.q)
        for i, r_ in zip(idx, rej, strict=True):
            xa, xb, r, perm = data[i]
            if not r_ and r.exceed < 10 and r.permutations < upto:
                r2 = perm.refine(xa, xb, r, upto)
                cells[i].p_value, cells[i].permutations = r2.p_value, r2.permutations
    if idx:
        pv = [cells[i].p_value for i in idx]
        rej, adj = stats.benjamini_hochberg(pv, opts.q), stats.bh_adjusted(pv)
        for i, r_, qv in zip(idx, rej, adj, strict=True):
            cells[i].rejected, cells[i].q_value = bool(r_), float(qv)
    for c, (xa, xb, _, _) in zip(cells, data, strict=True):
        if c.testable:
            _, counts = np.unique(np.concatenate([xa, xb]), return_counts=True)
            c.mde_lone = stats.min_detectable_tv(counts, c.n_a, c.n_b, opts.q / m, opts.power)
            c.mde_all = stats.min_detectable_tv(counts, c.n_a, c.n_b, opts.q, opts.power)
    return Comparison(name, (a.arm, b.arm), cells, time.perf_counter() - t0)


def spec_summary(delta: dict | None) -> dict | None:
    """Counters delta -> drafts, acceptance rate, mean accepted length (1 + accepted / drafts), per position."""
    if delta is None or delta.get("num_drafts") is None:
        return None
    d, k, acc = delta.get("num_drafts", 0), delta.get("num_draft_tokens", 0), delta.get("num_accepted_tokens", 0)
    per = list(delta.get("accepted_per_pos") or [])
    full = delta.get("num_full_accepts")  # None: the engine does not count fully accepted steps
    return {"num_drafts": d, "num_draft_tokens": k, "num_accepted_tokens": acc,
            "full_accepts": full, "rejections": d - full if full is not None else None,
            "acceptance_rate": acc / k if k else 0.0, "mean_accept_len": 1 + acc / d if d else 0.0,
            "per_position_rate": [x / d for x in per] if d else [], "source": delta.get("source")}


@dataclass
class GateResult:
    verdict: str
    comparisons: list[Comparison]
    spec: dict | None
    options: dict
    configs: list[dict]
    prompts: list[str]
    engines: dict[str, dict]
    failed: list[str]
    seconds: dict[str, float]
    missing: list[str] = field(default_factory=list)  # why the gate could not test (CANNOT TEST)
    untestable: list[str] = field(default_factory=list)
    # per sampling config: spec_summary of the candidate's counters over that config's generations (with
    # full_accepts = bonus rows drawn, rejections = verify steps that ended on a rejected draft)
    spec_by_config: dict[str, dict | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.verdict.startswith("PASS")

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)

    def summary(self) -> dict:
        comps = {}
        for c in self.comparisons:
            fin = [x for x in c.cells if x.testable]
            comps[c.name] = {
                "cells": len(c.cells), "testable": c.testable, "rejected": len(c.rejected),
                "rejected_cells": [(x.prompt, x.config, x.position, round(x.tv, 4), x.q_value) for x in c.rejected][:20],
                "min_p": min((x.p_value for x in fin), default=1.0),
                "max_tv": max((x.tv for x in fin), default=0.0),
                "median_mde_lone": _median([x.mde_lone for x in fin]),
                "median_mde_all": _median([x.mde_all for x in fin]),
                "frac_detectable_lone": sum(math.isfinite(x.mde_lone) for x in fin) / max(len(fin), 1)}
        return {"verdict": self.verdict, "passed": self.passed, "missing": self.missing,
                "untestable_samples": len(self.untestable), "spec": self.spec,
                "spec_by_config": self.spec_by_config, "not_tested": not_tested(self.spec_by_config),
                "comparisons": comps,
                "options": self.options, "configs": [c["name"] for c in self.configs],
                "num_prompts": len(self.prompts), "failed": len(self.failed), "seconds": self.seconds,
                "notes": list(self.notes)}


def not_tested(by_config: dict[str, dict | None]) -> list[str]:
    """Per sampling config, the accept-path branches its generations never reached (so no cell tested them):
    no fully accepted verify step = no bonus row drawn; no rejection = no residual draw. Empty when the
    engine does not count full accepts (then the report says the counts are unknown)."""
    out = []
    for name, s in by_config.items():
        if not s or s.get("full_accepts") is None:
            continue
        if s["num_drafts"] and not s["full_accepts"]:
            out.append(f"{name}: zero bonus rows (no verify step had every draft accepted)")
        if s["num_drafts"] and not s["rejections"]:
            out.append(f"{name}: zero rejections (no residual draw)")
    return out


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else math.inf


def missing_of(comparisons: Sequence[Comparison], untestable: Sequence[str]) -> list[str]:
    """What keeps the gate from a verdict: unreadable samples, or a comparison with no testable cell."""
    out = []
    if untestable:
        out.append(f"{len(untestable)} samples without readable tokens (first: {untestable[0]})")
    for c in comparisons:
        if not c.cells:
            out.append(f"{c.name} comparison: no cell (no sample on one side)")
        elif not c.testable:
            out.append(f"{c.name} comparison: 0 of {len(c.cells)} cells testable (every pooled cell holds a single "
                       "token: nothing to compare)")
    return out


def verdict_of(comparisons: Sequence[Comparison], spec: dict | None, failed: Sequence[str],
               missing: Sequence[str] = ()) -> str:
    if failed:
        return "INCOMPLETE"
    if any(c.rejected for c in comparisons):
        return "FAIL"
    if missing or not comparisons:
        return CANNOT_TEST
    if spec is None:
        return "PASS (speculation unverified)"
    if spec["num_drafts"] == 0:
        return "NOT SPECULATING"
    if spec["num_accepted_tokens"] == 0:
        return "NO DRAFT ACCEPTED"
    return "PASS"


def run_gate(baseline: EngineAdapter, candidate: EngineAdapter, opts: SampledGateOptions,
             configs: Sequence[SamplingConfig] = DEFAULT_CONFIGS, prompts: Sequence[tuple[str, str]] | None = None,
             baseline_samples: Samples | None = None, log: Callable[[str], None] | None = None,
             on_samples: Callable[[Samples], None] | None = None, progress: Any = None) -> GateResult:
    """Baseline vs candidate (and, with opts.null, candidate vs candidate on disjoint seeds). `progress`
    (cli/progress.py RunProgress, or None) hears each phase and each finished request."""
    say = log or (lambda s: None)
    tick = progress.advance if progress is not None else None

    def phase(name: str, n: int) -> None:
        if progress is not None:
            progress.phase(name, n)
    prompts = list(prompts) if prompts is not None else make_prompts(baseline, opts)
    if not prompts:
        raise SampledError("the prompt set is empty")
    n = len(prompts) * len(configs) * opts.samples
    if progress is not None:  # every phase's requests, for one ETA over the whole gate
        progress.plan(n * ((baseline_samples is None) + 1 + bool(opts.null)))
    secs: dict[str, float] = {}
    if baseline_samples is None:
        say(f"baseline: {n} generations of {opts.positions} tokens")
        phase("baseline (spec off)", n)
        baseline_samples = collect(baseline, prompts, configs, opts, "baseline", 0, tick)
        if on_samples:
            on_samples(baseline_samples)
    secs["baseline"] = baseline_samples.seconds
    say(f"candidate: {n} generations of {opts.positions} tokens")
    phase("candidate (spec on)", n)
    cand = collect(candidate, prompts, configs, opts, "candidate", 1, tick)
    if on_samples:
        on_samples(cand)
    secs["candidate"] = cand.seconds
    comps = [compare("spec", baseline_samples, cand, prompts, configs, opts)]
    failed = baseline_samples.failed + cand.failed
    untestable = baseline_samples.untestable + cand.untestable
    spec = cand.spec
    if opts.null:
        say(f"null: {n} more candidate generations (disjoint seeds)")
        phase("null (spec on, disjoint seeds)", n)
        cand2 = collect(candidate, prompts, configs, opts, "candidate2", 2, tick)
        if on_samples:
            on_samples(cand2)
        secs["null"] = cand2.seconds
        comps.append(compare("null", cand, cand2, prompts, configs, opts))
        failed += cand2.failed
        untestable += cand2.untestable
        spec = _add_counters(spec, cand2.spec)
    secs["stats"] = sum(c.seconds for c in comps)
    summ = spec_summary(spec)
    by_config = {c.name: spec_summary(_add_counters(cand.spec_by_config.get(c.name),
                                                    cand2.spec_by_config.get(c.name)) if opts.null
                                      else cand.spec_by_config.get(c.name)) for c in configs}
    missing = missing_of(comps, untestable)
    notes = []
    if opts.endpoint_type == "chat":
        arms = [baseline_samples, cand] + ([cand2] if opts.null else [])
        missing += rendering_problems(prompts, *arms)
        told = [a.arm for a in arms if any(k[0] == "ids" for ks in a.rendered.values() for k in ks)]
        notes.append("--endpoint-type chat: every request was the prompt as one user message (/v1/chat/completions, "
                     "the server's chat template), the same on both arms; rendered prompt ids reported by "
                     + (", ".join(told) if told else "no arm") + " (compared where reported, else usage prompt_tokens)")
        if not any(a.rendered for a in arms):
            notes.append("no arm reported what it rendered (no prompt_token_ids, no usage prompt_tokens): that both "
                         "arms computed the same prompt is unverified")
    return GateResult(verdict_of(comps, summ, failed, missing), comps, summ, asdict(opts),
                      [asdict(c) for c in configs], [p for p, _ in prompts],
                      {"baseline": baseline.describe(), "candidate": candidate.describe()}, failed, secs, missing,
                      untestable, by_config, notes)


def _add_counters(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a if b is None else b
    out = dict(a)
    for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        out[k] = a.get(k, 0) + b.get(k, 0)
    if a.get("num_full_accepts") is not None and b.get("num_full_accepts") is not None:
        out["num_full_accepts"] = a["num_full_accepts"] + b["num_full_accepts"]
    else:
        out.pop("num_full_accepts", None)
    pa, pb = list(a.get("accepted_per_pos") or []), list(b.get("accepted_per_pos") or [])
    n = max(len(pa), len(pb))
    out["accepted_per_pos"] = [x + y for x, y in zip(pa + [0] * (n - len(pa)), pb + [0] * (n - len(pb)), strict=True)]
    return out


__all__ = ["DEFAULT_CONFIGS", "END", "PROMPT_SETS", "Cell", "Comparison", "SampledGateOptions", "GateResult", "SampledError",
           "rendering_problems", "request",
           "Samples", "SamplingConfig", "collect", "compare", "missing_of", "echo_prompts", "load_prompts", "make_prompts",
           "not_tested", "parse_configs", "run_gate", "seed_of", "spec_summary", "verdict_of"]
