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
  accepted draft -> NO DRAFT ACCEPTED (both fail: the accept path was not exercised). An engine without
  counters is judged by its other evidence (lossless/checks.acceptance_evidence of its results: per-request
  draft counts, streamed chunks of several tokens): observed -> PASS, zero drafts -> NOT SPECULATING, none
  -> CANNOT TEST (harness/verdicts.NO_SPEC_EVIDENCE), or with `opts.assume_speculating`
  (--assume-speculating) "PASS (speculation asserted by the user, not observed)". Any failed request ->
  INCOMPLETE. Any rejected cell in the main comparison or the null (spec vs spec, disjoint seeds) comparison
  -> FAIL.
- Several candidates (each against the same baseline samples) are judged each on its own evidence: its
  comparisons are its own BH families (its spec cells one, its null cells another) at q / k for k candidates
  (a run of correct candidates still raises a false alarm with probability about q), and its verdict counts
  its own failed requests, unreadable samples, rendering problems and speculation (with the baseline's,
  which every candidate is compared with). One candidate's failure never marks another; the run's verdict
  combines theirs (harness/verdicts.combine: FAIL before CANNOT TEST before PASS).
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
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from specbench.harness.adapters.base import EngineAdapter, counters_delta, refuse_synthetic
from specbench.harness.verdicts import (
    CANNOT_TEST,
    FAIL,
    INCOMPLETE,
    NO_DRAFT_ACCEPTED,
    NO_SPEC_EVIDENCE,
    NOT_SPECULATING,
    PASS,
    combine,
    exit_code,
    is_cannot_test,
    is_pass,
    speculation_verdict,
)

from ..lossless.checks import AcceptanceEvidence, acceptance_evidence
from ..lossless.regret import first_divergence
from . import fit, stats
from .config import (
    DEFAULT_CONFIGS,
    END,
    PROMPT_SETS,
    SampledError,
    SampledGateOptions,
    SamplingConfig,
    parse_configs,
)
from .prompts import echo_prompts, load_prompts, make_prompts, request

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
    # per request id: the request sent and the tokens read back (the seed-repeat check re-sends some of them)
    requests: dict[str, Any] = field(default_factory=dict, repr=False)
    outputs: dict[str, list[int]] = field(default_factory=dict, repr=False)
    drafted: set[str] = field(default_factory=set, repr=False)  # ids whose request reported drafts of its own
    # speculation seen in the arm's results other than through counters (per-request draft counts, streamed
    # chunks of several tokens: lossless/checks.acceptance_evidence); the counters are `spec`
    evidence: AcceptanceEvidence = field(default_factory=lambda: AcceptanceEvidence("none"))
    # per prompt index: the prompt token ids the engine reported computing (the first reported), for fit.py
    prompt_ids: dict[int, list[int]] = field(default_factory=dict, repr=False)
    # fit.py's scores of these samples, kept for the runs that reuse them (the self-test's baseline)
    fit_scores: dict[tuple, Any] = field(default_factory=dict, repr=False)


@dataclass
class _Own:
    """One candidate's own evidence: its failed requests, unreadable samples, arms (its spec-on samples, and
    the null run's) and the speculation seen in its results."""

    failed: list[str]
    untestable: list[str]
    arms: list[Samples]
    evidence: AcceptanceEvidence


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
    results, keys, by_config, sent = [], [], {}, []
    rids: list[str] = []  # the request id of each request sent, in order
    chat = opts.endpoint_type == "chat"
    seconds = 0.0
    spec: dict | None = None
    for ci, c in enumerate(configs):
        reqs = []
        for pi, (pid, text) in enumerate(prompts):
            for si in range(opts.samples):
                s = seed_of(opts.seed, arm_index, pi * len(configs) + ci, si, cells, opts.samples)
                rid = f"{arm}-{pid}-{c.name}-{si}"
                reqs.append(request(text, chat, max_tokens=opts.positions, temperature=c.temperature,
                                    top_p=c.top_p, top_k=c.top_k, seed=s, ignore_eos=True,
                                    rid=rid, prompt_cache=False, **c.penalties()))
                keys.append((pi, ci))
                rids.append(rid)
        sent += reqs
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
    outputs: dict[str, list[int]] = {}
    drafted: set[str] = set()
    prompt_ids: dict[int, list[int]] = {}
    for key, rid, res in zip(keys, rids, results, strict=True):
        if not res.ok:
            failed.append(f"{res.rid}: {res.error}")
            continue
        if res.prompt_ids and key[0] not in prompt_ids:
            prompt_ids[key[0]] = list(res.prompt_ids)
        if chat and (rk := _rendered_key(res)) is not None:
            rendered.setdefault(key[0], set()).add(rk)
        out, why = _read_ids(adapter, res, retok, opts.positions)
        if out is None:
            untestable.append(f"{res.rid}: {why}")
            continue
        ids = list(out[:opts.positions])
        outputs[rid] = ids
        if res.drafted:
            drafted.add(rid)
        rows.setdefault(key, []).append(ids + [END] * (opts.positions - len(ids)))
    tokens = {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}
    return Samples(arm, tokens, failed, seconds, spec, untestable, by_config, rendered,
                   dict(zip(rids, sent, strict=True)), outputs, drafted,
                   acceptance_evidence(results, None, assumed=opts.assume_speculating), prompt_ids)


def _read_ids(adapter: EngineAdapter, res: Any, retok: dict[str, list[int] | None],
              positions: int) -> tuple[list[int] | None, str]:
    """One sample's tokens, or (None, why it is unreadable). An engine that reports text only has it
    re-tokenized: any fixed function of the output keeps the null hypothesis (equal distributions), so the
    test stays valid; positions are then those of the re-tokenized text."""
    out, how = res.output_ids, "output ids"
    if out is None or (res.text and not out):
        if res.text not in retok:
            retok[res.text] = adapter.tokenize_sync(res.text)
        out, how = retok[res.text], "re-tokenized text"
        if out is not None and res.text and not out:
            out = None  # an empty token list for a non-empty text is no sample
    if out is None:
        return None, "output token ids (neither reported nor re-tokenizable)"
    if not out:
        return None, f"no token returned ({how}; max_tokens {positions}, ignore_eos)"
    return list(out), how


@dataclass
class SeedRepeat:
    """Seeded samples of one arm sent again in one mixed batch, against their first draws (`seed_repeat`)."""

    arm: str
    compared: int = 0
    differ: int = 0
    examples: list[str] = field(default_factory=list)  # the first few that differed: rid and first position
    neighbours: int = 0  # requests of other parameters in the batch, each compared with itself run alone


REPEAT_GREEDY = 4  # the fewest neighbours in the seed repeat's mixed batch (every 4th greedy, the rest sampled)
NEIGHBOUR_T, NEIGHBOUR_K = 0.25, 2  # the sampled neighbours' config: far from any run's (near-greedy)


def neighbours(n: int) -> int:
    """The seed repeat's neighbours beside n repeated samples: half as many (at least REPEAT_GREEDY), so that
    whichever rows a batch-level parameter mix-up gets wrong, a good share of the batch shows it."""
    return max(REPEAT_GREEDY, n // 2)


def seed_repeat(adapter: EngineAdapter, samples: Samples, n: int,
                on_result: Callable[[Any], None] | None = None) -> SeedRepeat:
    """Re-send n of an arm's seeded requests (spread over its prompts and configs) and compare the tokens with
    their first draws. The first draws ran one sampling config per batch; the repeat sends them all at once,
    configs interleaved, beside `neighbours(n)` requests of other parameters (every 4th greedy, the rest
    sampled at NEIGHBOUR_T / NEIGHBOUR_K; each run alone first): an engine that honours
    per-request seeds and applies each row its own request's sampling parameters draws the same tokens in any
    batch, up to numerical noise at a CDF boundary. So this catches a speculative path that ignores the seed
    (the law stays exact) and one that mixes up rows' parameters when configs share a batch (each config's
    own batches never show it). Where requests report their own drafts, those that drafted go first (a sample
    that never reached a verify step cannot show a speculative path's use of the seed)."""
    out = SeedRepeat(samples.arm)
    rids = [r for r in samples.requests if r in samples.outputs]
    if not rids or n <= 0:
        return out
    pick = _spread([r for r in rids if r in samples.drafted], n)
    pick += _spread([r for r in rids if r not in samples.drafted], n - len(pick))
    first = samples.requests[pick[0]]
    # neighbours of other parameters: greedy, and sampled at a config no run uses (so even a one-config run has
    # mixed parameters in the batch); each run alone first, one at a time, for its reference
    plain = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    neigh = [replace(first, temperature=0.0, top_p=1.0, top_k=0, seed=None, rid=f"{samples.arm}-repeat-greedy-{i}",
                     **plain) if i % 4 == 3 else
             replace(first, temperature=NEIGHBOUR_T, top_p=1.0, top_k=NEIGHBOUR_K, seed=(first.seed or 0) + 7 * i + 1,
                     rid=f"{samples.arm}-repeat-neighbour-{i}", **plain) for i in range(neighbours(len(pick)))]
    alone = adapter.generate_sync(neigh, concurrency=1, on_result=on_result)
    by_config: dict[tuple, list[str]] = {}
    for r in pick:
        q = samples.requests[r]
        by_config.setdefault((q.temperature, q.top_p, q.top_k, q.repetition_penalty, q.presence_penalty,
                              q.frequency_penalty), []).append(r)
    order: list[str] = []  # round robin over the configs: neighbours of different parameters
    while any(by_config.values()):
        for xs in by_config.values():
            if xs:
                order.append(xs.pop(0))
    reqs = [samples.requests[r] for r in order]
    n0 = len(reqs)
    for i, g in enumerate(neigh):  # spread the neighbours through the batch, the first one leading it
        reqs.insert(min(len(reqs), i * n0 // len(neigh) + i), g)
    res = {r.rid: r for r in adapter.generate_sync(reqs, concurrency=len(reqs), on_result=on_result)}
    retok: dict[str, list[int] | None] = {}
    want = {r: samples.outputs[r] for r in order}
    for g, a in zip(neigh, alone, strict=True):
        ref = _read_ids(adapter, a, retok, first.max_tokens)[0] if a.ok else None
        if ref is not None:
            want[g.rid] = ref
            out.neighbours += 1
    for rid, first_ids in want.items():
        got = res.get(rid)
        if got is None or not got.ok:
            continue
        ids, _ = _read_ids(adapter, got, retok, len(first_ids))
        if ids is None:
            continue
        again = ids[:len(first_ids)]
        out.compared += 1
        if again != first_ids:
            out.differ += 1
            if len(out.examples) < 3:
                out.examples.append(f"{rid}: first difference at position {first_divergence(first_ids, again)}")
    return out


def _spread(xs: list[str], n: int) -> list[str]:
    """n of xs, evenly spaced (all of them when n >= len(xs))."""
    if n <= 0 or not xs:
        return []
    return xs[::max(len(xs) // n, 1)][:n]


SEED_ALPHA = 1e-3  # the seed-repeat check's level (one-sided Fisher exact, candidate vs baseline)


def seed_check(base: SeedRepeat, cand: SeedRepeat) -> dict:
    """The seed-repeat verdict of one candidate: FAIL when its repeats differ from their first draws
    significantly more often than the baseline's (one-sided Fisher exact at SEED_ALPHA); CANNOT TEST when
    either arm had nothing to compare or the baseline itself does not reproduce most of its seeded samples
    (seeds not honoured by the engine: nothing to hold the candidate to)."""
    from scipy.stats import fisher_exact  # noqa: PLC0415  (only where the check runs)

    out: dict = {"baseline": asdict(base), "candidate": asdict(cand), "p_value": None}
    if not base.compared or not cand.compared:
        out["verdict"] = f"{CANNOT_TEST} (no repeat to compare)"
        return out
    if 2 * base.differ > base.compared:
        out["verdict"] = f"{CANNOT_TEST} (the baseline reproduced {base.compared - base.differ} of {base.compared} " \
                         "seeded samples: the engine does not honour seeds)"
        return out
    p = float(fisher_exact([[cand.differ, cand.compared - cand.differ], [base.differ, base.compared - base.differ]],
                           alternative="greater")[1])
    out["p_value"] = p
    out["verdict"] = FAIL if p < SEED_ALPHA else PASS
    return out


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
    candidate: str = ""  # the candidate's label in a run of several candidates ("" with one)
    # per cell: (arm a's tokens, arm b's tokens, first-pass result, permuter), for refinement in `adjust`
    data: list[tuple[np.ndarray, np.ndarray, stats.PermResult, stats.Permuter]] = field(
        default_factory=list, repr=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.name}:{self.candidate}" if self.candidate else self.name

    @property
    def testable(self) -> int:
        return sum(c.testable for c in self.cells)

    @property
    def rejected(self) -> list[Cell]:
        return [c for c in self.cells if c.rejected]


def compare(name: str, a: Samples, b: Samples, prompts: Sequence[tuple[str, str]],
            configs: Sequence[SamplingConfig], opts: SampledGateOptions, candidate: str = "",
            family: bool = True) -> Comparison:
    """Every cell's permutation test; with `family` (the default) also refinement, BH and MDEs over this
    comparison's cells alone (`adjust`); a run of several candidates adjusts their comparisons together."""
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
    comp = Comparison(name, (a.arm, b.arm), cells, time.perf_counter() - t0, candidate, data)
    if family:
        adjust([comp], opts)
    return comp


def adjust(comps: Sequence[Comparison], opts: SampledGateOptions) -> None:
    """One Benjamini-Hochberg family at opts.q over the testable cells of `comps` together (m = their
    number): cells BH leaves unrejected near the p floor get extra permutations (up to ceil(2 m / q)), then
    BH decides `rejected` and the BH-adjusted `q_value`, and each cell's MDEs are computed at level q / m
    (lone) and q (all)."""
    t0 = time.perf_counter()
    idx = [(c, i) for c in comps for i, cell in enumerate(c.cells) if cell.testable]
    m = max(len(idx), 1)
    if opts.refine and idx:
        rej = stats.benjamini_hochberg([c.cells[i].p_value for c, i in idx], opts.q)
        upto = math.ceil(2 * m / opts.q)
        for (c, i), r_ in zip(idx, rej, strict=True):
            xa, xb, r, perm = c.data[i]
            if not r_ and r.exceed < 10 and r.permutations < upto:
                r2 = perm.refine(xa, xb, r, upto)
                c.cells[i].p_value, c.cells[i].permutations = r2.p_value, r2.permutations
    if idx:
        pv = [c.cells[i].p_value for c, i in idx]
        rej, adj = stats.benjamini_hochberg(pv, opts.q), stats.bh_adjusted(pv)
        for (c, i), r_, qv in zip(idx, rej, adj, strict=True):
            c.cells[i].rejected, c.cells[i].q_value = bool(r_), float(qv)
    for c, i in idx:
        cell, (xa, xb, _, _) = c.cells[i], c.data[i]
        _, counts = np.unique(np.concatenate([xa, xb]), return_counts=True)
        cell.mde_lone = stats.min_detectable_tv(counts, cell.n_a, cell.n_b, opts.q / m, opts.power)
        cell.mde_all = stats.min_detectable_tv(counts, cell.n_a, cell.n_b, opts.q, opts.power)
    share = (time.perf_counter() - t0) / max(len(comps), 1)
    for c in comps:
        c.seconds += share


def adjust_per_candidate(comps: Sequence[Comparison], opts: SampledGateOptions) -> None:
    """The multiple-testing correction of a run: each candidate's comparisons of one kind are their own family
    (its spec cells one, its null cells another; `adjust`), at q / k for the k candidates of the run. One
    candidate's cells never move another's BH threshold (a failing candidate's tiny p-values loosen only its
    own), and a run of k correct candidates still raises a false alarm with probability about q (Bonferroni
    over the candidates)."""
    labels = list(dict.fromkeys(c.candidate for c in comps))
    fam_opts = replace(opts, q=opts.q / max(len(labels), 1))
    for lab in labels:
        for kind in dict.fromkeys(c.name for c in comps):
            fam = [c for c in comps if c.candidate == lab and c.name == kind]
            if fam:
                adjust(fam, fam_opts)


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
    # a run of several candidates (each against the same baseline samples): their labels, each one's spec
    # summary and verdict; spec_by_config is then keyed "<candidate>:<config>". Empty with one candidate.
    candidates: list[str] = field(default_factory=list)
    spec_by_candidate: dict[str, dict | None] = field(default_factory=dict)
    candidate_verdicts: dict[str, str] = field(default_factory=dict)
    # per candidate label ("" with one): the seed-repeat check (seed_check), empty with opts.seed_repeat = 0
    seed_repeat: dict[str, dict] = field(default_factory=dict)
    # per candidate label ("" with one): what showed its speculation (source: counters, per-request draft tokens,
    # stream chunks, none) and its verdict (PASS, NOT SPECULATING, NO DRAFT ACCEPTED, PASS_ASSERTED, CANNOT TEST)
    speculation: dict[str, dict] = field(default_factory=dict)
    # the one-sample fit test (fit.py, `run_fit`): its control (the baseline's own samples), each candidate's
    # judgement keyed by label ("" with one), and why it did not run where it did not
    fit: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return is_pass(self.verdict)

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)

    def summary(self) -> dict:
        comps = {}
        for c in self.comparisons:
            fin = [x for x in c.cells if x.testable]
            comps[c.label] = {
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
                "comparisons": comps, "configurations": configurations(self),
                "candidates": list(self.candidates), "candidate_verdicts": dict(self.candidate_verdicts),
                "speculation": {k: dict(v) for k, v in self.speculation.items()},
                "family": {"q": self.options.get("q"), "candidates": max(len(self.candidates), 1),
                           "q_per_candidate": (self.options.get("q") or 0.0) / max(len(self.candidates), 1),
                           "rule": "Benjamini-Hochberg within each candidate's own cells (spec and null "
                                   "comparisons separately), at q / number of candidates"},
                "seed_repeat": {k: {"verdict": v["verdict"], "p_value": v["p_value"],
                                    "baseline": [v["baseline"]["differ"], v["baseline"]["compared"]],
                                    "candidate": [v["candidate"]["differ"], v["candidate"]["compared"]]}
                                for k, v in self.seed_repeat.items()},
                "fit": fit.fit_summary(self.fit),
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


def config_key(candidate: str, config: str) -> str:
    """The key of one configuration (a candidate and a sampling config) in `spec_by_config`."""
    return f"{candidate}:{config}" if candidate else config


def configuration_verdict(testable: int, rejected: int, s: dict | None, speculation: str = CANNOT_TEST) -> str:
    """One configuration's verdict: FAIL on a rejected cell; CANNOT TEST when it has no testable cell or its
    generations reached neither accept-path branch (no verify step: no bonus row, no rejection); PASS when
    both were reached, qualified when one was not or the engine does not count them. Without counters (`s`
    None) the candidate's `speculation` verdict (harness/verdicts.speculation_verdict of its other evidence)
    decides: observed -> PASS, qualified (the branches are not counted); asserted by the user -> that PASS;
    no evidence -> CANNOT TEST."""
    if rejected:
        return FAIL
    if not testable:
        return f"{CANNOT_TEST} (no testable cell)"
    if s is None:
        if speculation == PASS:
            return f"{PASS} (bonus rows and rejections not counted)"
        if speculation == CANNOT_TEST:
            return f"{CANNOT_TEST} (no evidence that the candidate speculated)"
        return speculation
    full, rej = s.get("full_accepts"), s.get("rejections")
    if not s["num_drafts"]:
        return f"{CANNOT_TEST} (no verify step: neither a bonus row nor a rejection tested)"
    if full is None:
        return f"{PASS} (bonus rows and rejections not counted)"
    if not full:
        return f"{PASS} (no bonus row tested)"
    if not rej:
        return f"{PASS} (no rejection tested)"
    return PASS


def configurations(res: GateResult) -> list[dict]:
    """Per configuration (candidate x sampling config): its cells in the spec comparison (testable, rejected,
    min p), the verify steps, bonus rows and rejections its generations reached, and its verdict."""
    labels = res.candidates or [""]
    out = []
    for lab in labels:
        spec = [c for c in res.comparisons if c.name == "spec" and c.candidate == lab]
        seen = (res.speculation.get(lab) or {}).get("verdict", CANNOT_TEST)
        for cfg in res.configs:
            cells = [x for c in spec for x in c.cells if x.config == cfg["name"]]
            fin = [x for x in cells if x.testable]
            s = res.spec_by_config.get(config_key(lab, cfg["name"]))
            rej = sum(x.rejected for x in cells)
            out.append({"candidate": lab, "config": cfg["name"], "cells": len(cells), "testable": len(fin),
                        "rejected": rej, "min_p": min((x.p_value for x in fin), default=1.0),
                        "verify_steps": s["num_drafts"] if s else None,
                        "bonus_rows": s.get("full_accepts") if s else None,
                        "rejections": s.get("rejections") if s else None,
                        "verdict": configuration_verdict(len(fin), rej, s, seen)})
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
               missing: Sequence[str] = (), evidence: AcceptanceEvidence | None = None) -> str:
    """One candidate's verdict: INCOMPLETE (a request failed), FAIL (a rejected cell), CANNOT TEST (evidence
    missing), then by speculation: the counters (`spec`: zero drafts NOT SPECULATING, nothing accepted NO DRAFT
    ACCEPTED), else the other `evidence` (lossless/checks.acceptance_evidence of the candidate's results:
    per-request draft counts, streamed chunks of several tokens) by harness/verdicts.speculation_verdict: none
    at all is CANNOT TEST unless the user asserted speculation."""
    if failed:
        return INCOMPLETE
    if any(c.rejected for c in comparisons):
        return FAIL
    if missing or not comparisons:
        return CANNOT_TEST
    if spec is None:
        ev = evidence if evidence is not None else AcceptanceEvidence("none")
        return speculation_verdict(ev.speculating, ev.assumed)
    if spec["num_drafts"] == 0:
        return NOT_SPECULATING
    if spec["num_accepted_tokens"] == 0:
        return NO_DRAFT_ACCEPTED
    return PASS


def run_gate(baseline: EngineAdapter, candidate: EngineAdapter | Sequence[EngineAdapter], opts: SampledGateOptions,
             configs: Sequence[SamplingConfig] = DEFAULT_CONFIGS, prompts: Sequence[tuple[str, str]] | None = None,
             baseline_samples: Samples | None = None, log: Callable[[str], None] | None = None,
             on_samples: Callable[[Samples], None] | None = None, progress: Any = None) -> GateResult:
    """Baseline vs candidate (and, with opts.null, candidate vs candidate on disjoint seeds). `progress`
    (cli/progress.py RunProgress, or None) hears each phase and each finished request.

    `candidate` may be several adapters (distinct names): each draws its samples on the candidate seeds and
    is compared with the same baseline samples; each candidate's spec comparison is its own BH family at
    opts.q / k (k candidates; its null comparison another), so a correct candidate is never failed by another's
    cells and a run of correct ones fails with probability about q. The verdict combines the candidates' own
    (FAIL before CANNOT TEST before PASS)."""
    say = log or (lambda s: None)
    tick = progress.advance if progress is not None else None
    cands = [candidate] if isinstance(candidate, EngineAdapter) else list(candidate)
    if not cands:
        raise SampledError("no candidate engine to test")
    multi = len(cands) > 1
    labels = [c.name for c in cands] if multi else [""]
    if len(set(labels)) < len(labels):
        raise SampledError(f"the candidates need distinct names to be told apart: {labels}")
    refuse_synthetic({"baseline": baseline.describe(), **{f"candidate {c.name}": c.describe() for c in cands}},
                     "the sampled gate", SampledError)

    def phase(name: str, n: int) -> None:
        if progress is not None:
            progress.phase(name, n)
    prompts = list(prompts) if prompts is not None else make_prompts(baseline, opts)
    if not prompts:
        raise SampledError("the prompt set is empty")
    n = len(prompts) * len(configs) * opts.samples
    reps = min(opts.seed_repeat, n)
    if progress is not None:  # every phase's requests, for one ETA over the whole gate
        fit_rows = opts.fit * n * (len(cands) + (baseline_samples is None or not baseline_samples.fit_scores))
        progress.plan(n * ((baseline_samples is None) + len(cands) * (1 + bool(opts.null))) + fit_rows
                      + (reps + 2 * neighbours(reps)) * (1 + len(cands)) * bool(reps))
    secs: dict[str, float] = {}
    if baseline_samples is None:
        say(f"baseline: {n} generations of {opts.positions} tokens")
        phase("baseline (spec off)", n)
        baseline_samples = collect(baseline, prompts, configs, opts, "baseline", 0, tick)
        if on_samples:
            on_samples(baseline_samples)
    secs["baseline"] = baseline_samples.seconds
    base_rep: SeedRepeat | None = None
    if reps:
        say(f"seed repeat: {reps} seeded baseline samples again, configs mixed in one batch")
        phase("seed repeat (baseline)", reps + 2 * neighbours(reps))
        base_rep = seed_repeat(baseline, baseline_samples, reps, tick)
    seeds: dict[str, dict] = {}
    spec_comps, null_comps, arms = [], [], [baseline_samples]
    failed, untestable = list(baseline_samples.failed), list(baseline_samples.untestable)
    by_cand: dict[str, dict | None] = {}
    raw_total: dict | None = None
    by_config: dict[str, dict | None] = {}
    own: dict[str, _Own] = {}  # per candidate
    for adapter, lab in zip(cands, labels, strict=True):
        tag = f"[{lab}]" if lab else ""
        say(f"candidate{' ' + lab if lab else ''}: {n} generations of {opts.positions} tokens")
        phase(f"candidate{' ' + lab if lab else ''} (spec on)", n)
        cand = collect(adapter, prompts, configs, opts, f"candidate{tag}", 1, tick)
        if on_samples:
            on_samples(cand)
        secs[f"candidate{tag}"] = cand.seconds
        if base_rep is not None:
            say(f"seed repeat{' ' + lab if lab else ''}: {reps} seeded candidate samples again, configs mixed")
            phase(f"seed repeat{' ' + lab if lab else ''} (spec on)", reps + 2 * neighbours(reps))
            seeds[lab] = seed_check(base_rep, seed_repeat(adapter, cand, reps, tick))
        spec_comps.append(compare("spec", baseline_samples, cand, prompts, configs, opts, lab, family=False))
        mine = _Own(list(cand.failed), list(cand.untestable), [cand], cand.evidence)
        failed += cand.failed
        untestable += cand.untestable
        arms.append(cand)
        spec = cand.spec
        cfg_counts = dict(cand.spec_by_config)
        if opts.null:
            say(f"null{' ' + lab if lab else ''}: {n} more candidate generations (disjoint seeds)")
            phase(f"null{' ' + lab if lab else ''} (spec on, disjoint seeds)", n)
            cand2 = collect(adapter, prompts, configs, opts, f"candidate2{tag}", 2, tick)
            if on_samples:
                on_samples(cand2)
            secs[f"null{tag}"] = cand2.seconds
            null_comps.append(compare("null", cand, cand2, prompts, configs, opts, lab, family=False))
            failed += cand2.failed
            untestable += cand2.untestable
            mine.failed += cand2.failed
            mine.untestable += cand2.untestable
            mine.arms.append(cand2)
            arms.append(cand2)
            spec = _add_counters(spec, cand2.spec)
            cfg_counts = {c.name: _add_counters(cand.spec_by_config.get(c.name), cand2.spec_by_config.get(c.name))
                          for c in configs}
        own[lab] = mine
        by_cand[lab] = spec_summary(spec)
        raw_total = spec if raw_total is None else _add_counters(raw_total, spec)
        for c in configs:
            by_config[config_key(lab, c.name)] = spec_summary(cfg_counts.get(c.name))
    adjust_per_candidate(spec_comps + null_comps, opts)
    no_null: list[Comparison | None] = [None] * len(spec_comps)
    comps = [x for pair in zip(spec_comps, null_comps or no_null, strict=True) for x in pair if x is not None]
    secs["stats"] = sum(c.seconds for c in comps)
    notes = []
    if opts.endpoint_type == "chat":
        told = [a.arm for a in arms if any(k[0] == "ids" for ks in a.rendered.values() for k in ks)]
        notes.append("--endpoint-type chat: every request was the prompt as one user message (/v1/chat/completions, "
                     "the server's chat template), the same on both arms; rendered prompt ids reported by "
                     + (", ".join(told) if told else "no arm") + " (compared where reported, else usage prompt_tokens)")
        if not any(a.rendered for a in arms):
            notes.append("no arm reported what it rendered (no prompt_token_ids, no usage prompt_tokens): that both "
                         "arms computed the same prompt is unverified")
    # Each candidate's verdict from its own evidence: its cells, its requests (and the baseline's, which every
    # candidate is compared with), its samples, its speculation.
    verdicts: dict[str, str] = {}
    missing_by: dict[str, list[str]] = {}
    speculation: dict[str, dict] = {}
    for lab in labels:
        mine = own[lab]
        cc = [c for c in comps if c.candidate == lab]
        miss = missing_of(cc, list(baseline_samples.untestable) + mine.untestable)
        if opts.endpoint_type == "chat":
            miss += rendering_problems(prompts, baseline_samples, *mine.arms)
        ev = mine.evidence
        counted = by_cand[lab]
        if counted is None and ev.speculating is None and not ev.assumed:
            miss.append(NO_SPEC_EVIDENCE)
        spec_v = (speculation_verdict(ev.speculating, ev.assumed) if counted is None
                  else _counter_verdict(counted))
        speculation[lab] = {"verdict": spec_v, "source": "counters" if counted is not None else ev.source,
                            "describe": _describe_counters(counted) if counted is not None else ev.describe()}
        missing_by[lab] = miss
        verdicts[lab] = verdict_of(cc, counted, list(baseline_samples.failed) + mine.failed, miss, ev)
    for lab, chk in seeds.items():  # a candidate that does not reproduce its seeded samples (enforced: fails)
        chk["enforced"] = opts.seed_repeat_gate
        who = f"seed repeat{' ' + lab if lab else ''}"
        c, b = chk["candidate"], chk["baseline"]
        if chk["verdict"] == FAIL and opts.seed_repeat_gate and verdicts[lab] != INCOMPLETE:
            verdicts[lab] = FAIL
        elif chk["verdict"] == FAIL:
            notes.append(f"{who}: the candidate's seeded samples came back different {c['differ']} of {c['compared']} "
                         f"times in a batch of mixed parameters, the baseline's {b['differ']} of {b['compared']} (p = "
                         f"{chk['p_value']:.1e}): advisory (--seed-repeat-gate makes it a FAIL). An engine whose "
                         "speculation adapts to load draws differently in another batch by design; otherwise its "
                         "speculative path ignores the request's seed or mixes up rows' sampling parameters")
        elif is_cannot_test(chk["verdict"]):
            notes.append(f"{who}: {chk['verdict']}")
    fit_res: dict = {}
    if opts.fit:  # the one-sample test: every candidate sample against the target's law at its prefix (fit.py)
        phase("fit (the baseline scores each sample)", n * (len(cands) + (not baseline_samples.fit_scores)))
        t_fit = time.perf_counter()
        fit_res = fit.run_fit(baseline, baseline_samples, [(lab, own[lab].arms[0]) for lab in labels], prompts,
                              configs, opts, _vocab(baseline), tick, say)
        secs["fit"] = time.perf_counter() - t_fit
        notes += fit_res.pop("notes", [])
        for lab, j in fit_res["candidates"].items():
            if j["verdict"] == FAIL and verdicts[lab] != INCOMPLETE:
                verdicts[lab] = FAIL
                notes.append(f"fit{' ' + lab if lab else ''}: FAIL: its samples do not follow the target's law at "
                             f"their own prefixes (pooled p = {j['p_value']:.1e} at level {j['level']:.1e}, "
                             f"{j['counts']['outside']} tokens outside the support)")
    total = spec_summary(raw_total)
    engines = {"baseline": baseline.describe()}
    engines.update({f"candidate{f':{lab}' if lab else ''}": a.describe() for a, lab in zip(cands, labels, strict=True)})

    def named(lab: str, xs: list[str]) -> list[str]:
        return [f"{lab}: {x}" if multi else x for x in xs]

    res = GateResult(combine(list(verdicts.values())), comps, total, asdict(opts), [asdict(c) for c in configs],
                     [p for p, _ in prompts], engines, failed, secs, [m for lab in labels for m in named(lab, missing_by[lab])],
                     untestable, by_config, notes, labels if multi else [], by_cand if multi else {},
                     verdicts if multi else {}, seeds, speculation, fit_res)
    # a configuration with no evidence is no pass: the run cannot vouch for that candidate
    confs = configurations(res)
    for lab in labels:
        if not is_pass(verdicts[lab]):
            continue
        blind = [f"configuration {config_key(r['candidate'], r['config'])}: {r['verdict'][len(CANNOT_TEST) + 1:]}"
                 for r in confs if r["candidate"] == lab and is_cannot_test(r["verdict"])]
        if blind:
            res.missing += blind
            verdicts[lab] = CANNOT_TEST
    if multi:
        res.candidate_verdicts = dict(verdicts)
    res.verdict = combine(list(verdicts.values()))
    return res


def _vocab(adapter: EngineAdapter) -> int | None:
    """The target's vocabulary size where the adapter describes it (bounds the tail's mass in fit.py)."""
    d = adapter.describe()
    for src in (d, d.get("model") if isinstance(d.get("model"), dict) else {}, d.get("config") or {}):
        v = src.get("vocab_size") if isinstance(src, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def _counter_verdict(spec: dict) -> str:
    """What a candidate's spec counters say of its speculation: drafts and accepted tokens, or which is zero."""
    if spec["num_drafts"] == 0:
        return NOT_SPECULATING
    return NO_DRAFT_ACCEPTED if spec["num_accepted_tokens"] == 0 else PASS


def _describe_counters(spec: dict) -> str:
    return (f"spec counters: {spec['num_drafts']} verify steps, {spec['num_draft_tokens']} draft tokens, "
            f"{spec['num_accepted_tokens']} accepted")


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


__all__ = ["DEFAULT_CONFIGS", "END", "PROMPT_SETS", "SEED_ALPHA", "Cell", "Comparison", "SampledGateOptions", "GateResult",
           "SampledError", "SeedRepeat", "seed_check", "seed_repeat",
           "adjust", "adjust_per_candidate", "config_key", "configuration_verdict", "configurations", "rendering_problems", "request",
           "Samples", "SamplingConfig", "collect", "compare", "missing_of", "echo_prompts", "load_prompts", "make_prompts",
           "not_tested", "parse_configs", "run_gate", "seed_of", "spec_summary", "verdict_of"]
