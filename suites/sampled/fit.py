"""The sampled gate's one-sample test: each sample, token by token, against the target's own law at its prefix.

The two-sample comparison (gate.compare) asks whether spec-on and spec-off draw the same marginal at each
(prompt, config, position) cell; a bias spread thinly over many steps stays under every cell's detection limit.
This test asks something sharper of every sampled token: was it drawn from the law the target gives that very
prefix? The baseline target scores each sample (teacher-forced, `EngineAdapter.score`: the raw top-K logprobs
of each continuation position and the sampled token's own), so the law is known at every position the sample
reached, whatever path it took.

Contract:
- `law` rebuilds one position's sampling law from the raw top-K logprobs in the order the bundled engine and
  vLLM apply it (engine/sampler.py, written again here from its definition: the oracle shares no code with its
  subject): temperature, then top-k, then top-p on the tempered probabilities (a token is kept while the mass of
  the tokens before it is below top_p). The tail below the top-K is unknown, so the law is taken on S, the
  tokens surely in the support (a prefix of the order; noise margins: `LOGIT_MARGIN` on each logit, the derived
  relative margin on the nucleus's cumulative mass, and the tail's largest possible tempered mass, `tail_bound`).
  On S the relative probabilities are exact. A sampled token outside S that is surely outside the support (k
  tokens beat it by more than the margin, or the nucleus surely closed before it) is `outside`: no draw from
  the target's law gives it. One inside neither is `unsure` (not tested).
- Conditional on the sampled token being in S (a set fixed by the prefix), its randomized probability integral
  transform under the law on S (tokens in descending probability, u = F(x-) + V p(x), V uniform) is uniform,
  and independent of everything before it (each u is uniform given the past), so a sample's kept transforms are
  i.i.d. U(0, 1) under the null, and so are the transforms pooled over samples, prompts and configs.
- `judge`: the Cramer-von Mises test of uniformity (scipy) on the pooled transforms and on each config's,
  Bonferroni over those 1 + C tests at level `alpha`; any `outside` token also rejects. Positions whose S holds
  one token carry no information (counted, not tested).
- The baseline's own samples, scored the same way, are the control: a control that does not fit means the law
  rebuilt here is not the one the engine draws from (another order of temperature and truncation, a different
  top-p rule, scores that are not the raw model logprobs), so the candidates' fits are CANNOT TEST, not FAIL.
- `power`: the smallest per-step total variation the pooled test detects with probability `power` at `alpha`,
  when at every tested position that much of the law's mass moves to its most likely token (the direction a
  drafter's bias usually takes: drafts are likely tokens) or away from it, simulated on the run's own laws.
- Configs with penalties are not tested (their law depends on the history in ways the raw scores do not give).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats as sps

from specbench.harness.verdicts import CANNOT_TEST, FAIL, PASS

from .config import END, FIT_MARGIN, SampledGateOptions, SamplingConfig

LOGIT_MARGIN = FIT_MARGIN  # config.py: the noise allowed at a support boundary, in logits (--fit-margin)
TOP_K = 20  # raw logprobs asked of the scorer per position (vLLM's default max_logprobs)
POWER_SIMS = 64  # simulated runs per step of the power search


@dataclass
class Law:
    """One position's law restricted to S (ids in descending probability, probs summing to 1), and where the
    sampled token fell: 'kept' (in S), 'outside' (surely outside the support), 'unsure', or 'single' (S is one
    token: no information)."""

    ids: list[int]
    probs: np.ndarray
    status: str
    index: int = -1  # the sampled token's index in ids when kept


def tail_bound(lps: np.ndarray, t: float, vocab: int | None) -> float:
    """The largest tempered mass the tokens below the top-K can hold, relative to the top token's weight
    (weights exp((l - l_0) / t)): the raw tail mass R = 1 - sum(top-K probabilities), each tail token at most
    the K-th probability. t <= 1: R in tokens at the K-th probability (the weight is convex); t > 1: R spread
    evenly over every other token of the vocabulary (concave), infinite when the vocabulary is unknown."""
    p = np.exp(lps)
    r = max(0.0, 1.0 - float(p.sum()))
    if r <= 0.0:
        return 0.0
    p0, pk = float(p[0]), float(p[-1])
    if t <= 1.0:
        return (r / pk) * (pk / p0) ** (1.0 / t)
    if vocab is None or vocab <= len(lps):
        return math.inf
    n = vocab - len(lps)
    return n * ((r / n) / p0) ** (1.0 / t)


def law(top: dict[int, float], tok: int, tok_lp: float | None, cfg: SamplingConfig, vocab: int | None = None,
        margin: float = LOGIT_MARGIN) -> Law:
    """The config's sampling law at one position, on the tokens surely in its support (module docstring)."""
    items = sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))
    if not items:
        return Law([], np.zeros(0), "unsure")
    ids = [i for i, _ in items]
    lps = np.array([v for _, v in items], dtype=np.float64)
    n, t, k, m = len(ids), cfg.temperature, cfg.top_k, 2 * margin
    w = np.exp((lps - lps[0]) / t)
    rank = ids.index(tok) if tok in top else None
    x_lp = float(lps[rank]) if rank is not None else tok_lp
    # top-k: surely in when fewer than k tokens can beat it by the margin (the (k+1)-th is at most lps[k], or at
    # most the last known one when k >= n); surely out when k tokens beat it by the margin
    if k > 0:
        sure = int((lps > (lps[k] if k < n else lps[-1]) + m).sum())
        kth = lps[k - 1] if k <= n else None

        def out_k(lp: float | None) -> bool:
            return kth is not None and lp is not None and lp < kth - m
        tail_in = kth is None or not out_k(float(lps[-1]))
    else:
        sure, tail_in = n, True

        def out_k(lp: float | None) -> bool:
            return False
    in_k = np.array([not out_k(float(v)) for v in lps])
    out_p = False
    if cfg.top_p < 1.0:  # the nucleus under the smallest and the largest normalisation the scores allow
        slack = math.exp(2 * m / t)  # the weights' largest relative error, on the cumulative and the normaliser
        cw, neg = np.concatenate([[0.0], np.cumsum(w)]), -lps
        # the mass before a token at most / at least: tokens within the margin of it may come either side of it
        hi = cw[np.searchsorted(neg, -(lps - m), side="left")] - w
        z_lo = float(w[:sure].sum())
        z_hi = float(w[in_k].sum()) + (tail_bound(lps, t, vocab) if tail_in else 0.0)
        kept = hi[:sure] < cfg.top_p * z_lo / slack
        sure = int(np.argmin(kept)) if not kept.all() else sure
        x_ref = x_lp if x_lp is not None else float(lps[-1])  # a tail token of unknown logprob: below the known
        x_before = float(cw[np.searchsorted(neg, -(x_ref + m), side="left")])
        out_p = x_before >= cfg.top_p * z_hi * slack
    sure = max(1, sure)
    probs = w[:sure] / w[:sure].sum()
    if rank is not None and rank < sure:
        return Law(ids[:sure], probs, "single" if sure == 1 else "kept", rank)
    if out_k(x_lp) or out_p or (rank is None and not tail_in):
        return Law(ids[:sure], probs, "outside")
    return Law(ids[:sure], probs, "unsure")


def pit(lw: Law, v: float) -> float:
    """The randomized probability integral transform of the sampled token under a kept law."""
    i = lw.index
    return float(lw.probs[:i].sum() + v * lw.probs[i])


@dataclass
class ArmFit:
    """One arm's scored samples: per config, the kept positions' laws and transforms, and the counts of the
    positions not tested (by why)."""

    arm: str
    laws: dict[str, list[np.ndarray]] = field(default_factory=dict)
    pits: dict[str, list[float]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"kept": 0, "single": 0, "unsure": 0, "outside": 0,
                                                              "unscored": 0})
    outside: list[str] = field(default_factory=list)  # the first few outside tokens, named
    skipped: list[str] = field(default_factory=list)  # configs not tested, and why
    scored: int = 0  # score requests sent
    seconds: float = 0.0


def rows_of(samples: Any, configs: Sequence[SamplingConfig]) -> list[tuple[int, int, list[int]]]:
    """(prompt index, config index, the sample's token ids up to its first missing position) for every sample
    of an arm (gate.Samples.tokens), in a stable order."""
    out = []
    for (pi, ci), arr in sorted(samples.tokens.items()):
        for row in arr:
            ids = [int(x) for x in row]
            if END in ids:
                ids = ids[:ids.index(END)]
            if ids:
                out.append((pi, ci, ids))
    return out


def score_arm(scorer: Any, samples: Any, prompt_ids: dict[int, list[int]], configs: Sequence[SamplingConfig],
              opts: SampledGateOptions, vocab: int | None = None, seed: int = 0,
              tick: Callable[[Any], None] | None = None) -> ArmFit:
    """Score every sample of one arm with `scorer` (the baseline adapter) and rebuild each position's law.
    A prompt without token ids, a config with penalties and a score the scorer declines are counted, not
    guessed."""
    t0 = time.perf_counter()
    fit = ArmFit(samples.arm)
    rng = np.random.default_rng(seed)
    todo: list[tuple[int, int, list[int]]] = []
    for pi, ci, ids in rows_of(samples, configs):
        c = configs[ci]
        if c.penalties():
            why = f"{c.name}: penalties (the law depends on the history; raw scores do not give it)"
            if why not in fit.skipped:
                fit.skipped.append(why)
            continue
        if pi not in prompt_ids:
            fit.counts["unscored"] += len(ids)
            continue
        todo.append((pi, ci, ids))
    uniq: dict[tuple[int, tuple[int, ...]], int] = {}  # (prompt, sample) -> how many samples repeat it
    for pi, _, ids in todo:
        uniq[(pi, tuple(ids))] = uniq.get((pi, tuple(ids)), 0) + 1
    scores: dict[tuple[int, tuple[int, ...]], Any] = {}

    async def run_all() -> None:
        sem = asyncio.Semaphore(max(1, opts.concurrency))

        async def one(key: tuple[int, tuple[int, ...]]) -> None:
            async with sem:
                try:
                    scores[key] = await scorer.score(prompt_ids[key[0]], list(key[1]), top_k=TOP_K)
                except Exception as e:  # a declined or failed score is counted, never guessed
                    scores[key] = e
            if tick is not None:
                for _ in range(uniq[key]):
                    tick(None)
        await asyncio.gather(*(one(k) for k in sorted(uniq)))

    scorer.run(run_all())
    fit.scored = len(uniq)
    for pi, ci, ids in todo:
        c = configs[ci]
        sc = scores.get((pi, tuple(ids)))
        if sc is None or isinstance(sc, Exception) or len(sc.positions) != len(ids):
            fit.counts["unscored"] += len(ids)
            continue
        for j, (tok, pos) in enumerate(zip(ids, sc.positions, strict=True)):
            lw = law(pos.top or {}, tok, pos.logprob, c, vocab, opts.fit_margin)
            fit.counts[lw.status] += 1
            if lw.status == "kept":
                fit.laws.setdefault(c.name, []).append(lw.probs)
                fit.pits.setdefault(c.name, []).append(pit(lw, float(rng.random())))
            elif lw.status == "outside" and len(fit.outside) < 10:
                fit.outside.append(f"prompt {pi}, {c.name}, position {j}: token {tok} (logprob "
                                   f"{pos.logprob if pos.logprob is not None else 'unknown'}) is outside the "
                                   f"support; the top {min(3, len(lw.ids))} were {lw.ids[:3]}")
    fit.seconds = time.perf_counter() - t0
    return fit


def cvm_p(u: Sequence[float] | np.ndarray) -> float:
    """Cramer-von Mises p-value of uniformity on [0, 1] (1.0 with fewer than two values)."""
    if len(u) < 2:
        return 1.0
    return float(sps.cramervonmises(np.asarray(u, dtype=np.float64), "uniform").pvalue)


def judge(fit: ArmFit, alpha: float) -> dict:
    """The arm's tests: pooled and per config at alpha / (1 + configs) each (Bonferroni), and its outside
    tokens. 'rejected' when any test rejects or any token is outside; 'tested' is False with no kept position."""
    names = [n for n in fit.pits if fit.pits[n]]
    pooled = [u for n in names for u in fit.pits[n]]
    level = alpha / (1 + len(names)) if names else alpha
    per = {n: {"positions": len(fit.pits[n]), "p_value": cvm_p(fit.pits[n]),
               "mean_u": float(np.mean(fit.pits[n]))} for n in names}
    p = cvm_p(pooled)
    rejected = bool(fit.counts["outside"]) or p < level or any(v["p_value"] < level for v in per.values())
    return {"arm": fit.arm, "tested": bool(pooled), "positions": len(pooled), "p_value": p, "level": level,
            "mean_u": float(np.mean(pooled)) if pooled else None, "per_config": per, "counts": dict(fit.counts),
            "outside": list(fit.outside), "skipped": list(fit.skipped), "rejected": rejected,
            "scored": fit.scored, "seconds": round(fit.seconds, 3)}


def _padded(laws: Sequence[np.ndarray]) -> np.ndarray:
    k = max(len(p) for p in laws)
    out = np.zeros((len(laws), k))
    for i, p in enumerate(laws):
        out[i, :len(p)] = p
    return out


def _shift(p: np.ndarray, delta: float, toward: bool) -> np.ndarray:
    """Each row moved by total variation up to delta: mass to its first (most likely) token from the others in
    proportion (toward), or from it to the others (away); capped where a row has less to move."""
    q = p.copy()
    top = p[:, 0]
    if toward:
        d = np.minimum(delta, 1.0 - top)
        rest = np.where(1.0 - top > 0, (1.0 - top - d) / np.maximum(1.0 - top, 1e-300), 0.0)
        q[:, 1:] *= rest[:, None]
        q[:, 0] = top + d
    else:
        d = np.minimum(delta, top)
        rest = np.where(1.0 - top > 0, (1.0 - top + d) / np.maximum(1.0 - top, 1e-300), 0.0)
        q[:, 1:] *= rest[:, None]
        q[:, 0] = top - d
    return q


def cvm_stats(u: np.ndarray) -> np.ndarray:
    """The Cramer-von Mises statistic of each row of u [S, n] (uniformity on [0, 1]), as scipy computes it."""
    n = u.shape[1]
    grid = (2 * np.arange(1, n + 1) - 1) / (2 * n)
    return 1 / (12 * n) + ((grid - np.sort(u, axis=1)) ** 2).sum(axis=1)


def cvm_critical(n: int, alpha: float) -> float | None:
    """The statistic above which scipy's Cramer-von Mises test rejects at alpha for n values, by bisection on
    its null distribution function (scipy's own, private: None where this scipy lacks it, and the power search
    then calls the public test once per simulated run)."""
    try:
        from scipy.stats._hypotests import _cdf_cvm
    except ImportError:  # pragma: no cover - another scipy
        return None
    lo, hi = 0.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1.0 - float(_cdf_cvm(mid, n)) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def _power(p: np.ndarray, cdf: np.ndarray, delta: float, toward: bool, alpha: float, draws: np.ndarray,
           vs: np.ndarray, crit: float | None) -> float:
    q = _shift(p, delta, toward)
    qc = np.cumsum(q, axis=1)
    rows = np.arange(p.shape[0])
    us = np.empty(draws.shape)
    for s in range(draws.shape[0]):
        idx = np.minimum((qc < draws[s][:, None] * qc[:, -1:]).sum(axis=1), p.shape[1] - 1)
        us[s] = cdf[rows, idx] - p[rows, idx] + vs[s] * p[rows, idx]
    if crit is not None:
        return float((cvm_stats(us) > crit).mean())
    return sum(cvm_p(u) < alpha for u in us) / draws.shape[0]


def detectable_tv(laws: Sequence[np.ndarray], alpha: float, power: float = 0.8, sims: int = POWER_SIMS,
                  seed: int = 0) -> dict[str, float]:
    """The smallest per-step total variation (a grid of 1e-3 steps, bisected) that the pooled test detects with
    probability >= power at alpha, when every tested position moves that much mass toward / away from its most
    likely token; inf when even 0.5 is not (or no law has two tokens)."""
    laws = [p for p in laws if len(p) > 1]
    if not laws:
        return {"toward": math.inf, "away": math.inf}
    p = _padded(laws)
    cdf = np.cumsum(p, axis=1)
    rng = np.random.default_rng(seed)
    draws, vs = rng.random((sims, len(p))), rng.random((sims, len(p)))
    crit = cvm_critical(len(p), alpha)
    out = {}
    for toward in (True, False):
        lo, hi = 0, 500  # in units of 1e-3
        if _power(p, cdf, hi / 1000, toward, alpha, draws, vs, crit) < power:
            out["toward" if toward else "away"] = math.inf
            continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _power(p, cdf, mid / 1000, toward, alpha, draws, vs, crit) >= power:
                hi = mid
            else:
                lo = mid
        out["toward" if toward else "away"] = hi / 1000
    return out


def run_fit(scorer: Any, baseline: Any, candidates: Sequence[tuple[str, Any]], prompts: Sequence[tuple[str, str]],
            configs: Sequence[SamplingConfig], opts: SampledGateOptions, vocab: int | None = None,
            tick: Callable[[Any], None] | None = None, say: Callable[[str], None] | None = None) -> dict:
    """The fit test of a run: the baseline's samples (the control) and each candidate's (label, gate.Samples),
    every one scored by `scorer` (the baseline adapter). Each candidate's tests at q / candidates (its own
    family, as the comparisons are); the control at the same level. Returns {"control", "candidates": {label:
    judgement with "verdict" and "detectable_tv"}, "why" (set when the fit could not run), "notes"}."""
    say = say or (lambda x: None)
    out: dict[str, Any] = {"top_k": TOP_K, "margin": opts.fit_margin, "candidates": {}, "notes": []}
    pids: dict[int, list[int]] = {}
    for arm in [baseline, *(s for _, s in candidates)]:
        for pi, ids in arm.prompt_ids.items():
            pids.setdefault(pi, ids)
    if opts.endpoint_type != "chat":  # a chat prompt's ids are its rendering: only what the engine reported
        for pi, (_, text) in enumerate(prompts):
            try:
                ids = scorer.tokenize_sync(text) if pi not in pids else None
            except Exception:  # an engine that cannot tokenize this text: the prompt goes unscored, counted
                ids = None
            if ids:
                pids[pi] = list(ids)
    rows = rows_of(baseline, configs)
    probe = rows[0] if rows else None
    if probe is None or probe[0] not in pids:
        out["why"] = "no prompt token ids (none reported, none tokenized)" if probe else "no baseline sample"
    else:
        out["why"] = _probe(scorer, pids[probe[0]], probe[2][:1])
    if out.get("why"):
        for lab, _ in candidates:
            out["candidates"][lab] = {"verdict": f"{CANNOT_TEST} ({out['why']})", "tested": False}
        return out
    k = max(len(candidates), 1)
    level = opts.q / k
    say(f"fit: the baseline scores every sample ({len(rows)} of the control's, then each candidate's)")
    key = (opts.fit_margin, tuple(c.name for c in configs), vocab)  # the control: scored once per samples
    if key not in baseline.fit_scores:
        baseline.fit_scores[key] = score_arm(scorer, baseline, pids, configs, opts, vocab, opts.seed, tick)
    control = judge(baseline.fit_scores[key], level)
    out["control"] = control
    for ci, (lab, samples) in enumerate(candidates):
        af = score_arm(scorer, samples, pids, configs, opts, vocab, opts.seed + 1 + ci, tick)
        j = judge(af, level)
        j["detectable_tv"] = detectable_tv([p for n in af.laws for p in af.laws[n]],
                                           j["level"], opts.power, seed=opts.seed)
        if not control["tested"]:
            j["verdict"] = f"{CANNOT_TEST} (the control, the baseline's own samples, kept no position)"
        elif control["rejected"]:
            j["verdict"] = (f"{CANNOT_TEST} (the control does not fit: the baseline's own samples give p = "
                            f"{control['p_value']:.1e}, {control['counts']['outside']} outside the support; the law "
                            "rebuilt from the scores is not the one the engine draws from)")
        elif not j["tested"]:
            j["verdict"] = f"{CANNOT_TEST} (no position kept)"
        else:
            j["verdict"] = FAIL if j["rejected"] else PASS
        out["candidates"][lab] = j
    if control["tested"] and control["rejected"]:
        out["notes"].append(f"fit: the control failed (p = {control['p_value']:.1e}, {control['counts']['outside']} "
                            "outside): the fit is CANNOT TEST for every candidate; the two-sample comparison decides")
    return out


def _probe(scorer: Any, prompt: list[int], cont: list[int]) -> str | None:
    """Why the scorer cannot score (None: it can): it declines, or its one try fails."""
    try:
        if scorer.score_sync(prompt, cont, top_k=TOP_K) is None:
            return "the baseline gives no teacher-forced scores (echo with logprobs, prompt_logprobs)"
    except Exception as e:
        return f"the baseline's teacher-forced score failed ({type(e).__name__}: {str(e)[:120]})"
    return None


def fit_summary(res: dict) -> dict:
    """The fit's part of the gate summary: per candidate the verdict, positions, p-value and detectable TV."""
    if not res:
        return {}
    c = res.get("control") or {}
    return {"why": res.get("why"), "margin": res.get("margin"),
            "control": {k: c.get(k) for k in ("positions", "p_value", "rejected", "counts")} if c else None,
            "candidates": {lab: {k: j.get(k) for k in ("verdict", "positions", "p_value", "level", "counts",
                                                         "detectable_tv", "outside")}
                           for lab, j in res.get("candidates", {}).items()}}


__all__ = ["LOGIT_MARGIN", "TOP_K", "ArmFit", "Law", "cvm_p", "detectable_tv", "fit_summary", "judge", "law",
           "pit", "rows_of", "run_fit", "score_arm", "tail_bound"]
