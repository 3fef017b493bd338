"""The sampling fault `reused_uniform` acts on the soft-q accept path, and where it cannot act (#18 item 7).

Under the soft-q n-gram candidate (`spec=ngram,mix=0.2`) the self-test's `reused_uniform` cells were
identical to the clean engine's. Cause: not the plumbing (the rule reaches `accept_sampled_batch` with the
proposer's q rows, and the torch path reads `one_uniform` whether q is None or not) but the ratios: with
q_i(g) = 0.8 + 0.2 f(g) for the lookup token g, the echoed token's p(g) >= q(g) at every draft after the
first (ratio clipped at 1: accepted whatever the uniform), and a draft taken from the frequency part lies
outside the config's top-k / top-p support (ratio 0: rejected whatever the uniform). Reusing the first
uniform then changes no accept decision. The tests pin both halves: the fault changes the outcome when the
later ratios are moderate, and is exactly inert when they are all 0 or >= 1.
"""

from __future__ import annotations

import pytest
import torch

from specbench.engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from specbench.engine.faults import make_faults
from specbench.engine.spec.sampling import LOSSLESS, accept_sampled_batch

V, K, MIX = 6, 3, 0.2
REUSED = make_faults(("reused_uniform",)).accept_rule


def _soft_q(n: int, seed: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """n requests of K drafts from the soft-q n-gram's shape: q_i = (1 - MIX) one_hot(g_i) + MIX f, g_i = i + 1."""
    f = torch.full((V,), 1.0 / V)
    q = torch.stack([(1 - MIX) * torch.nn.functional.one_hot(torch.tensor(i + 1), V).float() + MIX * f
                     for i in range(K)])
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, K]: draft i from q_i
    return drafts.tolist(), [q] * n


def _p_rows(n: int, p_g: list[float]) -> torch.Tensor:
    """Target rows: row i puts p_g[i] on g_i and the rest on token 0 (outside q's lookup tokens); bonus row uniform."""
    rows = []
    for i in range(K):
        r = torch.zeros(V)
        r[i + 1], r[0] = p_g[i], 1.0 - p_g[i]
        rows.append(r)
    rows.append(torch.full((V,), 1.0 / V))
    return torch.stack(rows).repeat(n, 1)


def _resolve(drafts, qs, p, rule, seed: int = 5):
    gens = [torch.Generator().manual_seed(seed * 7919 + b) for b in range(len(drafts))]
    return accept_sampled_batch(drafts, qs, p, gens, rule, kernel=False)


def test_reused_uniform_changes_the_accept_with_soft_q_rows():
    """Moderate ratios p(g)/q(g) (about 0.6) at every draft: reusing the first uniform accepts more runs in
    full (min(r0, r1) instead of r0 r1), on the same generators, with q rows given (not point masses)."""
    n = 4000
    drafts, qs = _soft_q(n, seed=1)
    p = _p_rows(n, [0.5, 0.5, 0.5])
    clean, bad = _resolve(drafts, qs, p, LOSSLESS), _resolve(drafts, qs, p, REUSED)
    differ = sum(a != b for a, b in zip(clean, bad, strict=True))
    assert differ > n // 10, differ
    full = [sum(m == K for m, _ in out) for out in (clean, bad)]
    assert full[1] > 2 * full[0], full  # r^3 ~ 0.2 of the g-drafted runs vs min(r) ~ 0.6


def test_reused_uniform_is_inert_when_later_ratios_clip():
    """The measured regime of the soft-q candidate: draft 0's ratio moderate, every later ratio 0 or >= 1
    (p(g) = 1 >= q(g); a frequency draft has p = 0). Then no accept decision reads a later uniform, and the
    fault's outcome equals the clean one exactly: the fault is inert by arithmetic, not by its plumbing."""
    n = 2000
    drafts, qs = _soft_q(n, seed=2)
    p = _p_rows(n, [0.5, 1.0, 1.0])
    assert _resolve(drafts, qs, p, LOSSLESS) == _resolve(drafts, qs, p, REUSED)


@pytest.mark.parametrize("fault,flag", [("reused_uniform", "one_uniform"), ("q_next_row", "q_next_row"),
                                        ("bonus_residual", "bonus_residual")])
def test_the_rule_reaches_the_accept_with_the_soft_q_proposers_rows(tiny_target, monkeypatch, fault, flag):
    """Engine plumbing: with `ngram_mix` > 0 and a sampling fault armed, every sampled resolve gets the
    proposer's q rows (not None) and the rule with the fault's flag set."""
    import specbench.engine.accept_step as accept_step

    seen: list[tuple[bool, bool]] = []
    real = accept_step.accept_sampled_batch

    def spy(drafts, qs, p, gens, rule=LOSSLESS, kernel=True):
        if any(drafts):
            seen.append((all(q is not None for q, d in zip(qs, drafts, strict=True) if d), getattr(rule, flag)))
        return real(drafts, qs, p, gens, rule, kernel)

    monkeypatch.setattr(accept_step, "accept_sampled_batch", spy)
    eng = LLMEngine(EngineConfig(model=str(tiny_target), device="cpu", dtype="float32",
                                 spec=SpecConfig(method="ngram", ngram_mix=MIX), faults=(fault,)))
    prompt = "one two three four one two three four one two three four one two"
    eng.generate([prompt] * 4, [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s)
                                for s in range(4)])
    assert seen, "no sampled verify step drafted"
    assert all(has_q and one for has_q, one in seen), seen
