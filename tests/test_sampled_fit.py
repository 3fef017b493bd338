"""The sampled gate's one-sample fit test (suites/sampled/fit.py): the law rebuilt from top-K scores against the
engine's own sampling transform over the whole vocabulary, the transform's uniformity under the null, its power,
and tokens outside the support."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specbench.engine.config import SamplingParams
from specbench.engine.sampler import sampling_probs
from specbench.suites.sampled import fit
from specbench.suites.sampled.config import SamplingConfig, parse_configs

V = 300
CONFIGS = parse_configs("t=0.6,p=0.95;t=0.7;t=1.3,k=3;t=1,p=0.8;t=0.9,k=8,p=0.9")


def _logits(rng: np.random.Generator, scale: float) -> np.ndarray:
    return rng.standard_normal(V) * scale


def _engine_law(logits: np.ndarray, c: SamplingConfig) -> np.ndarray:
    """The bundled engine's own law over the whole vocabulary (engine/sampler.sampling_probs)."""
    p = SamplingParams(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, max_tokens=1)
    return sampling_probs(torch.tensor(logits[None], dtype=torch.float64), p)[0].double().numpy()


def _scores(logits: np.ndarray) -> tuple[dict[int, float], np.ndarray]:
    lp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    top = np.argsort(-lp)[:fit.TOP_K]
    return {int(i): float(lp[i]) for i in top}, lp


def _pits(c: SamplingConfig, n: int, seed: int, bias: float = 0.0) -> tuple[list[float], dict[str, int]]:
    """n positions: random logits, a token drawn from the engine's law (optionally `bias` of the mass moved to
    the most likely token), judged by the rebuilt law."""
    rng = np.random.default_rng(seed)
    us, counts = [], {"kept": 0, "single": 0, "unsure": 0, "outside": 0}
    for _ in range(n):
        logits = _logits(rng, float(rng.uniform(0.5, 4.0)))
        q = _engine_law(logits, c)
        q = q / q.sum()
        if bias:
            top = int(np.argmax(q))
            d = min(bias, 1 - q[top])
            q = q * ((1 - q[top] - d) / max(1 - q[top], 1e-300))
            q[top] = _engine_law(logits, c)[top] + d
            q = q / q.sum()
        tok = int(rng.choice(V, p=q))
        top, lp = _scores(logits)
        lw = fit.law(top, tok, float(lp[tok]), c, vocab=V)
        counts[lw.status] += 1
        if lw.status == "kept":
            us.append(fit.pit(lw, float(rng.random())))
    return us, counts


@pytest.mark.parametrize("c", CONFIGS, ids=[c.name for c in CONFIGS])
def test_the_rebuilt_law_is_the_engines_on_the_tokens_it_keeps(c):
    rng = np.random.default_rng(1)
    for _ in range(200):
        logits = _logits(rng, float(rng.uniform(0.5, 4.0)))
        full = _engine_law(logits, c)
        top, lp = _scores(logits)
        tok = int(np.argmax(full))
        lw = fit.law(top, tok, float(lp[tok]), c, vocab=V)
        assert lw.status in ("kept", "single")
        assert full[lw.ids].min() > 0, "a token of S is outside the engine's support"
        np.testing.assert_allclose(lw.probs, full[lw.ids] / full[lw.ids].sum(), rtol=1e-5, atol=1e-7)  # the engine works in fp32
        # every token the law calls outside has no mass under the engine's law
        for t in range(V):
            if fit.law(top, t, float(lp[t]), c, vocab=V).status == "outside":
                assert full[t] == 0.0


@pytest.mark.parametrize("c", CONFIGS, ids=[c.name for c in CONFIGS])
def test_draws_from_the_engines_law_fit(c):
    us, counts = _pits(c, 1500, seed=2)
    assert counts["outside"] == 0
    assert counts["kept"] > 300, counts
    assert fit.cvm_p(us) > 1e-3


def test_a_thin_bias_toward_the_likely_token_is_seen():
    c = CONFIGS[0]
    us, _ = _pits(c, 3000, seed=3, bias=0.08)
    assert fit.cvm_p(us) < 1e-3
    clean, _ = _pits(c, 3000, seed=3)
    assert fit.cvm_p(clean) > 1e-3


def test_a_token_past_top_k_is_outside_and_one_inside_the_margin_is_not():
    c = SamplingConfig("t1-k2", 1.0, top_k=2)
    top = {1: -0.5, 2: -1.0, 3: -3.0, 4: -3.2}
    assert fit.law(top, 3, -3.0, c).status == "outside"
    assert fit.law(top, 99, -4.0, c).status == "outside"  # a tail token below the known ones
    near = {1: -0.5, 2: -1.0, 3: -1.0 - fit.LOGIT_MARGIN, 4: -3.2}
    assert fit.law(near, 3, near[3], c).status == "unsure"  # the 2nd and 3rd within noise of each other


def test_a_tail_token_under_a_temperature_alone_is_not_tested_not_failed():
    c = SamplingConfig("t0.7", 0.7)
    top = {1: -0.7, 2: -1.2, 3: -2.0}
    lw = fit.law(top, 42, -6.0, c)
    assert lw.status == "unsure" and lw.ids == [1, 2, 3]


def test_tail_bound_holds_the_tails_largest_tempered_mass():
    rng = np.random.default_rng(4)
    for t in (0.6, 1.0, 1.3):
        for _ in range(50):
            logits = _logits(rng, float(rng.uniform(0.5, 3.0)))
            lp = logits - np.log(np.exp(logits).sum())
            order = np.argsort(-lp)
            known, tail = lp[order[:fit.TOP_K]], lp[order[fit.TOP_K:]]
            true = float(np.exp((tail - known[0]) / t).sum())
            assert true <= fit.tail_bound(known, t, V) * (1 + 1e-9)


def test_judge_rejects_outside_tokens_and_bonferroni_over_configs():
    a = fit.ArmFit("x")
    rng = np.random.default_rng(5)
    a.pits = {"c1": list(rng.random(500)), "c2": list(rng.random(500))}
    j = fit.judge(a, 0.05)
    assert not j["rejected"] and j["positions"] == 1000 and math.isclose(j["level"], 0.05 / 3)
    a.counts["outside"] = 1
    assert fit.judge(a, 0.05)["rejected"]
    b = fit.ArmFit("y")
    b.pits = {"c1": list(rng.random(500) ** 1.5)}
    assert fit.judge(b, 0.05)["rejected"]


def test_detectable_tv_falls_with_more_positions():
    rng = np.random.default_rng(6)
    laws = [np.sort(rng.dirichlet(np.ones(6)))[::-1] for _ in range(4000)]
    small = fit.detectable_tv(laws[:500], 0.01, sims=32)
    big = fit.detectable_tv(laws, 0.01, sims=32)
    assert 0 < big["toward"] < small["toward"] < math.inf
    assert big["toward"] < 0.05
    assert fit.detectable_tv([np.array([1.0])], 0.01)["toward"] == math.inf


def test_prompt_logprobs_from_gives_the_full_paths_entries_and_skips_the_rest(tiny_target):
    """SamplingParams.prompt_logprobs_from (the local adapter's fast `score`) against prompt_logprobs on every row,
    with the prompt split over several prefill chunks (max_num_batched_tokens 16) and in one batch of mixed starts."""
    from specbench.engine import LLM

    llm = LLM(tiny_target, max_num_batched_tokens=16, num_pages=64)
    ids = [(7 * i + 3) % 4000 + 10 for i in range(45)]
    full = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=5))[0].prompt_logprobs
    starts = [0, 1, 2, 15, 16, 17, 33, 44, 45, 60]
    outs = llm.generate([ids] * len(starts), [SamplingParams(max_tokens=1, prompt_logprobs=5, prompt_logprobs_from=f)
                                              for f in starts])
    for f, out in zip(starts, outs, strict=True):
        got = out.prompt_logprobs
        assert len(got) == len(ids)
        for p in range(len(ids)):
            if p < max(f, 1):
                assert got[p] is None, (f, p)
            else:
                assert got[p][1].keys() == full[p][1].keys(), (f, p)
                assert got[p][0] == pytest.approx(full[p][0], abs=1e-5)
        assert out.output_ids == outs[0].output_ids  # the sampled first token is read from the same last row


def test_the_local_scores_fast_path_equals_the_simple_one(tiny_target):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.harness.engines import build_adapter, parse_engine

    a = build_adapter(parse_engine(f"local:{tiny_target}"), name="b")
    try:
        prompt, cont = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32, 33]
        fast = a.score_sync(prompt, cont, top_k=20)
        LocalAdapter.score_all_rows = True
        try:
            slow = a.score_sync(prompt, cont, top_k=20)
        finally:
            LocalAdapter.score_all_rows = False
        assert fast is not None and slow is not None and len(fast.positions) == len(cont) == len(slow.positions)
        for x, y in zip(fast.positions, slow.positions, strict=True):
            assert x.token_id == y.token_id and x.top.keys() == y.top.keys() and len(x.top) == 20
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
    finally:
        a.close()


def test_a_near_tie_at_the_nucleus_boundary_is_not_outside():
    """top_p 0.3 over two tokens 0.0022 logits apart: which one the engine keeps depends on noise the margin
    allows, so neither is outside; the old rule (the mass before it in the scorer's order) called the second one
    outside, a false FAIL waiting for a bf16 engine."""
    c = SamplingConfig("t1-p0.3", 1.0, top_p=0.3)
    top = {1: math.log(0.45), 2: math.log(0.449), 3: math.log(0.05), 4: math.log(0.03)}
    assert fit.law(top, 2, top[2], c).status == "unsure"
    assert fit.law(top, 1, top[1], c).status in ("single", "unsure")
    assert fit.law(top, 3, top[3], c).status == "outside"  # 0.899 of the mass surely before it
