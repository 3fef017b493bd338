"""logit_bias (OpenAI's) and min_tokens (vLLM's) in the engine, under speculation, in the server and in the gates.

- `apply_bias` / `mask_min_tokens` on constructed rows; a verify row's min_tokens mask follows its own output
  position (`accept_step.shaped`), and the two faults move exactly that; property (hypothesis): every verify row is
  shaped as the decode step at its position would be (each of the three verify faults breaks it);
- greedy with a bias and with min_tokens: speculation on == off token for token (fp32, CPU), the bias acts, the
  min_tokens output has its one correct shape (m tokens without the stop token, then it);
- the logit-bias and min-tokens engine gates: PASS on the clean engine (speculating), FAIL with
  verify_ignores_logit_bias / min_tokens_at_span_start, CANNOT TEST on a baseline that ignores the option;
- bad values are refused by name (SamplingParams, the server, the engine's vocabulary check)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specbench.engine import LLM, SamplingParams
from specbench.engine.config import ConfigError
from specbench.engine.sampler import apply_bias, mask_min_tokens

N = 40


def test_bias_and_min_tokens_on_rows():
    rows = torch.zeros(3, 8)
    apply_bias(rows, SamplingParams(logit_bias={"2": 1.5, 5: -100}))
    assert rows[:, 2].tolist() == [1.5] * 3 and rows[:, 5].tolist() == [-100.0] * 3 and rows[:, 0].abs().sum() == 0
    p = SamplingParams(min_tokens=3, stop_token_ids=(4, 99), max_tokens=8)
    m = mask_min_tokens(torch.zeros(3, 8), p, [1, 2, 3], eos={7})
    assert m[:2, 4].tolist() == [float("-inf")] * 2 and m[:2, 7].tolist() == [float("-inf")] * 2
    assert m[2].abs().sum() == 0  # position 3 = min_tokens: allowed (99 is past the vocabulary: nothing to mask)
    ign = mask_min_tokens(torch.zeros(1, 8), p.with_(ignore_eos=True), [0], eos={7})
    assert ign[0, 7] == 0 and ign[0, 4] == float("-inf")  # ignore_eos: EOS is no stop, so it is not masked


def test_a_verify_rows_min_tokens_mask_follows_its_own_position():
    from specbench.engine.accept_step import shaped
    from specbench.engine.request import Request
    from specbench.engine.scheduler import Span
    from specbench.engine.spec.sampling import AcceptRule

    p = SamplingParams(min_tokens=3, stop_token_ids=(6,), logit_bias={6: 2.0}, max_tokens=8)
    req = Request("r", [1, 2], p)
    req.output_ids = [3, 4]  # row j of the span predicts output token 2 + j
    span = Span(req, [4, 5, 5], 2, "verify", drafts=[5, 5])
    logits = torch.zeros(3, 8)
    out = shaped([span], [(0, 3)], logits, set())
    assert out[:, 6].tolist() == [float("-inf"), 2.0, 2.0]
    late = shaped([span], [(0, 3)], logits, set(), AcceptRule(min_tokens_at_start=True))
    assert late[:, 6].tolist() == [float("-inf")] * 3  # the fault: every row masked as the first
    unbiased = shaped([span], [(0, 3)], logits, set(), AcceptRule(verify_unbiased=True))
    assert unbiased[1:, 6].tolist() == [0.0, 0.0]  # the fault: no bias on the verify rows


def test_bad_values_are_refused_by_name():
    for kw, name in ((dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={1: 100.5}), "logit_bias"),
                     (dict(logit_bias={-1: 1}), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
                     (dict(min_tokens=17, max_tokens=16), "min_tokens")):
        with pytest.raises(ConfigError, match=name):
            SamplingParams(**kw)


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_draft):
    plain, spec = LLM(tiny_target, num_pages=512), LLM(tiny_target, draft=tiny_draft, num_pages=512)
    yield plain, spec
    plain.close()
    spec.close()


def _echo(plain, prompt: str) -> str:
    first = plain.generate([prompt], SamplingParams(max_tokens=N, ignore_eos=True))[0].output_ids
    return prompt + plain.engine.tokenizer.decode(first) + "\n\n" + prompt  # the answer comes back: drafts accepted


def test_speculation_keeps_biased_greedy_exact(engines, gsm8k_prompts):
    plain, spec = engines
    prompts = [gsm8k_prompts[0], _echo(plain, gsm8k_prompts[1])]
    free = plain.generate(prompts, SamplingParams(max_tokens=N, ignore_eos=True))
    ban = {o.output_ids[i]: -100.0 for o in free for i in (2, 9)}
    sp = SamplingParams(max_tokens=N, ignore_eos=True, logit_bias=ban)
    want, got = plain.generate(prompts, sp), spec.generate(prompts, sp)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert [w.output_ids for w in want] != [f.output_ids for f in free]  # the bias acts
    assert not any(t in ban for g in got for t in g.output_ids)
    assert sum(sum(g.spec["accepted_runs"]) for g in got) > 0  # drafts were accepted under the bias


@pytest.mark.parametrize("m", [1, 4, 9, 17])
def test_speculation_keeps_min_tokens_exact(engines, gsm8k_prompts, m):
    plain, spec = engines
    prompt = _echo(plain, gsm8k_prompts[2])
    t = plain.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_ids[3]
    sp = SamplingParams(max_tokens=N, stop_token_ids=(t,), min_tokens=m, logit_bias={t: 100.0})
    want, got = plain.generate([prompt], sp)[0], spec.generate([prompt], sp)[0]
    assert got.output_ids == want.output_ids
    assert len(want.output_ids) == m + 1 and want.output_ids[-1] == t and t not in want.output_ids[:-1]
    assert want.finish_reason == "stop" and want.stop_reason == t


def test_min_tokens_holds_back_stop_strings(engines, gsm8k_prompts):
    """vLLM's rule: no stop of any kind before min_tokens, and a stop string whose text ended earlier never stops."""
    plain, _ = engines
    free = plain.generate([gsm8k_prompts[0]], SamplingParams(max_tokens=N, ignore_eos=True))[0]
    stop = free.text[:3].strip() or free.text[:3]
    early = plain.generate([gsm8k_prompts[0]], SamplingParams(max_tokens=N, ignore_eos=True, stop=[stop]))[0]
    held = plain.generate([gsm8k_prompts[0]], SamplingParams(max_tokens=N, ignore_eos=True, stop=[stop],
                                                             min_tokens=10))[0]
    assert early.finish_reason == "stop" and len(early.output_ids) < 10
    assert len(held.output_ids) >= 10


def test_a_bias_past_the_vocabulary_is_refused_at_admission(engines):
    plain, _ = engines
    with pytest.raises(ConfigError, match="logit_bias"):
        plain.generate([[1, 2, 3]], SamplingParams(logit_bias={10**6: 1.0}))


def _gate(name, tiny_target, tiny_draft, gsm8k_prompts, faults=(), baseline_kw=None):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
    from specbench.suites.lossless.registry import GATES

    base = LocalAdapter.from_dirs(tiny_target, spec="off", num_pages=512, name="baseline", **(baseline_kw or {}))
    cand = LocalAdapter.from_dirs(tiny_target, draft=tiny_draft, spec="dflash", num_pages=512, name="cand",
                                  faults=faults)
    try:
        prompts = [Prompt(f"p{i}", base.engine.tokenizer.encode(t)) for i, t in enumerate(gsm8k_prompts[:2])]
        return asyncio.run(GATES[name](base, cand, prompts, 48, GreedyGateOptions()))
    finally:
        base.close()
        cand.close()


@pytest.mark.parametrize("name", ["logit-bias", "min-tokens"])
def test_the_gates_pass_the_clean_engine(name, tiny_target, tiny_draft, gsm8k_prompts):
    run = _gate(name, tiny_target, tiny_draft, gsm8k_prompts)
    assert run.verdict == "PASS", (run.cannot_test, [(p.pid, p.status, p.reason) for p in run.prompts])
    assert run.stats.num_drafts > 0 and all(c.ok for c in run.checks)


@pytest.mark.parametrize("name,fault", [("logit-bias", "verify_ignores_logit_bias"),
                                        ("min-tokens", "min_tokens_at_span_start"),
                                        ("min-tokens", "verify_ignores_logit_bias")])
def test_the_gates_fail_their_faults(name, fault, tiny_target, tiny_draft, gsm8k_prompts):
    run = _gate(name, tiny_target, tiny_draft, gsm8k_prompts, (fault,))
    assert run.verdict == "FAIL", (fault, [(p.pid, p.status) for p in run.prompts])
    shape = "banned-tokens" if name == "logit-bias" else "min-tokens-shape"
    assert any(c.name == shape and not c.ok for c in run.checks)  # the exact check catches it, whatever the ties


class _Ignoring:
    """A baseline adapter that drops one request option (an engine that does not honour it)."""

    def __init__(self, inner, field: str) -> None:
        self._inner, self._field = inner, field

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def generate(self, reqs, concurrency=None):
        from dataclasses import replace

        return await self._inner.generate([replace(r, **{self._field: type(getattr(r, self._field))()})
                                           if getattr(r, self._field) else r for r in reqs], concurrency=concurrency)


@pytest.mark.parametrize("name,field", [("logit-bias", "logit_bias"), ("min-tokens", "min_tokens")])
def test_a_baseline_that_ignores_the_option_leaves_the_gate_cannot_test(name, field, tiny_target, tiny_draft,
                                                                        gsm8k_prompts):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
    from specbench.suites.lossless.registry import GATES

    base = LocalAdapter.from_dirs(tiny_target, spec="off", num_pages=512, name="baseline")
    cand = LocalAdapter.from_dirs(tiny_target, draft=tiny_draft, spec="dflash", num_pages=512, name="cand")
    try:
        prompts = [Prompt(f"p{i}", base.engine.tokenizer.encode(t)) for i, t in enumerate(gsm8k_prompts[:2])]
        run = asyncio.run(GATES[name](_Ignoring(base, field), cand, prompts, 48, GreedyGateOptions()))
    finally:
        base.close()
        cand.close()
    assert run.verdict == "CANNOT TEST" and run.cannot_test, (run.verdict, run.cannot_test)


def test_the_server_takes_the_options_and_refuses_bad_ones():
    from specbench.harness.server.protocol import APIError, parse_completion

    ok = parse_completion({"prompt": "a", "logit_bias": {"5": -3, "7": 100}, "min_tokens": 3, "max_tokens": 8})
    assert ok.logit_bias == ((5, -3.0), (7, 100.0)) and ok.min_tokens == 3
    for body, name in (({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
                       ({"prompt": "a", "logit_bias": {"1": 101}}, "logit_bias"),
                       ({"prompt": "a", "logit_bias": [[1, 2]]}, "logit_bias"),
                       ({"prompt": "a", "min_tokens": -1}, "min_tokens")):
        with pytest.raises(APIError, match=name):
            parse_completion(body)


def test_the_openai_bodies_carry_the_options():
    from specbench.harness.adapters.base import GenRequest
    from specbench.harness.adapters.openai_request import completions_body, native_body

    r = GenRequest(prompt=[1, 2], max_tokens=8, logit_bias={5: -100.0}, min_tokens=3)
    b = completions_body(r, "m", "vllm", stream=False, continuous_usage=False, extras=True, extra_body={})
    assert b["logit_bias"] == {"5": -100.0} and b["min_tokens"] == 3
    n = native_body(r, "llamacpp", stream=False, extras=True, extra_body={})
    assert n["logit_bias"] == [[5, -100.0]]


def test_a_verify_span_is_shaped_row_for_row_as_decode_steps_would_be():
    """Property (hypothesis): every row j of a verify span is shaped exactly as a decode step whose output so far
    is the request's output plus the first j drafts: penalties, bias and the min_tokens mask, in any combination."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from specbench.engine.accept_step import shaped
    from specbench.engine.request import Request
    from specbench.engine.scheduler import Span

    v = 12
    ids = st.integers(0, v - 1)

    @settings(max_examples=150, deadline=None)
    @given(out=st.lists(ids, max_size=6), drafts=st.lists(ids, min_size=1, max_size=5),
           bias=st.dictionaries(ids, st.floats(-100, 100, allow_nan=False), max_size=3),
           min_tokens=st.integers(0, 12), stop=st.lists(ids, max_size=2), eos=st.sets(ids, max_size=2),
           ignore_eos=st.booleans(), rp=st.sampled_from([1.0, 1.3]), fp=st.sampled_from([0.0, 0.5]),
           seed=st.integers(0, 2**16))
    def check(out, drafts, bias, min_tokens, stop, eos, ignore_eos, rp, fp, seed):
        p = SamplingParams(max_tokens=32, logit_bias=bias, min_tokens=min_tokens, stop_token_ids=tuple(stop),
                           ignore_eos=ignore_eos, repetition_penalty=rp, frequency_penalty=fp)
        req = Request("r", [1, 2, 3], p)
        req.output_ids = list(out)
        n = len(drafts) + 1
        logits = torch.randn(n, v, generator=torch.Generator().manual_seed(seed))
        span = Span(req, [out[-1] if out else 3, *drafts], len(out) + 3, "verify", drafts=list(drafts))
        got = shaped([span], [(0, n)], logits, set(eos))
        for j in range(n):
            one = Request("d", [1, 2, 3], p)
            one.output_ids = list(out) + list(drafts[:j])
            dspan = Span(one, [0], 0, "decode")
            want = shaped([dspan], [(0, 1)], logits[j:j + 1], set(eos))
            assert torch.equal(got[j:j + 1], want), (j, got[j], want[0])

    check()
