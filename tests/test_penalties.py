"""Penalties (repetition / presence / frequency, vLLM's and OpenAI's semantics) in the engine and under speculation.

- `apply_penalties` against a per-token reference;
- greedy with penalties: speculation on == off token for token (fp32, CPU), penalties on != off (they act), and
  a verify row's history holds the drafts before it (`accept_step.penalized` on a constructed span);
- the penalties gate: PASS on the clean engine (speculating), FAIL with `verify_ignores_penalties`;
- the server accepts the fields and refuses out-of-range values by name."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specbench.engine import LLM, SamplingParams
from specbench.engine.config import ConfigError
from specbench.engine.sampler import apply_penalties

N = 40


def _reference(row: list[float], p: SamplingParams, prompt: list[int], out: list[int]) -> list[float]:
    x = list(row)
    for t in set(prompt) | set(out):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def test_apply_penalties_matches_a_per_token_reference():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 12, generator=g)
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.2)
    prompt, outs = [1, 2, 2], [[], [3, 3, 5], [1, 7]]
    got = apply_penalties(rows, p, prompt, outs)
    for r in range(3):
        want = _reference(rows[r].tolist(), p, prompt, outs[r])
        assert torch.allclose(got[r], torch.tensor(want), atol=1e-6)
    assert torch.equal(rows, rows.clone())  # the input is not modified


def test_bad_penalties_are_refused_by_name():
    for kw, name in ((dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=2.5),
                     "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty")):
        with pytest.raises(ConfigError, match=name):
            SamplingParams(**kw)


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_draft):
    plain, spec = LLM(tiny_target, num_pages=512), LLM(tiny_target, draft=tiny_draft, num_pages=512)
    yield plain, spec
    plain.close()
    spec.close()


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.3), dict(frequency_penalty=0.8, presence_penalty=0.4),
                                dict(repetition_penalty=1.05, frequency_penalty=0.2)])
def test_speculation_keeps_penalized_greedy_exact(engines, gsm8k_prompts, kw):
    plain, spec = engines
    tok = plain.engine.tokenizer
    first = plain.generate([gsm8k_prompts[0]], SamplingParams(max_tokens=N, ignore_eos=True))[0].output_ids
    echo = gsm8k_prompts[0] + tok.decode(first) + "\n\n" + gsm8k_prompts[0]  # the answer comes back: drafts accepted
    prompts = [gsm8k_prompts[0], gsm8k_prompts[1], echo]
    sp = SamplingParams(max_tokens=N, ignore_eos=True, **kw)
    want, got = plain.generate(prompts, sp), spec.generate(prompts, sp)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert sum(sum(g.spec["accepted_runs"]) for g in got) > 0  # drafts were accepted under the penalties
    off = plain.generate(prompts, SamplingParams(max_tokens=N, ignore_eos=True))
    assert [o.output_ids for o in off] != [w.output_ids for w in want]  # the penalties changed something


def test_a_verify_row_counts_the_drafts_before_it():
    from specbench.engine.accept_step import shaped
    from specbench.engine.request import Request
    from specbench.engine.scheduler import Span
    from specbench.engine.spec.sampling import AcceptRule

    p = SamplingParams(frequency_penalty=1.0)
    req = Request("r", [1, 2], p)
    req.output_ids = [3]
    span = Span(req, [3, 4, 4], 3, "verify", drafts=[4, 4])
    logits = torch.zeros(3, 8)
    out = shaped([span], [(0, 3)], logits, set())
    assert out[:, 3].tolist() == [-1.0, -1.0, -1.0] and out[:, 4].tolist() == [0.0, -1.0, -2.0]
    raw = shaped([span], [(0, 3)], logits, set(), AcceptRule(verify_unpenalized=True))
    assert torch.equal(raw, logits)


def _gate(tiny_target, tiny_draft, gsm8k_prompts, faults, n=2):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
    from specbench.suites.lossless.registry import GATES

    base = LocalAdapter.from_dirs(tiny_target, spec="off", num_pages=512, name="baseline")
    cand = LocalAdapter.from_dirs(tiny_target, draft=tiny_draft, spec="dflash", num_pages=512, name="cand",
                                  faults=faults)
    try:
        prompts = [Prompt(f"p{i}", base.engine.tokenizer.encode(t)) for i, t in enumerate(gsm8k_prompts[:n])]
        return asyncio.run(GATES["penalties"](base, cand, prompts, 48, GreedyGateOptions()))
    finally:
        base.close()
        cand.close()


def test_penalties_gate_passes_the_clean_engine(tiny_target, tiny_draft, gsm8k_prompts):
    run = _gate(tiny_target, tiny_draft, gsm8k_prompts, ())
    assert run.verdict == "PASS", [(p.pid, p.status, p.reason) for p in run.prompts]
    from specbench.suites.lossless.gates.penalties import PEN_SETTINGS
    assert len(run.prompts) == 2 * 2 * len(PEN_SETTINGS) and run.stats.num_drafts > 0  # (prompt, echo) x setting


def test_penalties_gate_fails_a_verify_row_penalized_without_the_drafts(tiny_target, tiny_draft, gsm8k_prompts):
    """verify_penalty_history_stale: each verify row counts the output before the span, not the drafts before the
    row: only a token repeated inside an accepted run moves, so it needs the gate's four prompts."""
    run = _gate(tiny_target, tiny_draft, gsm8k_prompts, ("verify_penalty_history_stale",), n=4)
    assert run.verdict == "FAIL", [(p.pid, p.status, p.reason) for p in run.prompts]


def test_penalties_gate_fails_a_verify_path_without_penalties(tiny_target, tiny_draft, gsm8k_prompts):
    run = _gate(tiny_target, tiny_draft, gsm8k_prompts, ("verify_ignores_penalties",))
    assert run.verdict == "FAIL"
    assert any(p.status == "fail" and p.divergences and p.divergences[0].judgement is not None for p in run.prompts)


def test_the_server_takes_penalties_and_refuses_bad_ones():
    from specbench.harness.server.protocol import APIError, parse_completion

    ok = parse_completion({"prompt": "a", "repetition_penalty": 1.2, "presence_penalty": -0.5,
                           "frequency_penalty": 2})
    assert (ok.repetition_penalty, ok.presence_penalty, ok.frequency_penalty) == (1.2, -0.5, 2.0)
    for body, name in (({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
                       ({"prompt": "a", "frequency_penalty": 3}, "frequency_penalty")):
        with pytest.raises(APIError, match=name):
            parse_completion(body)


def test_sampled_gate_with_a_penalty_config(tiny_target, tiny_draft):
    """`--configs t=1,rp=1.5`: the law compared is the penalized one on both arms. The clean engine passes (fixed
    seeds: deterministic here; a correct engine fails a run with probability about q by design), and one whose
    verify path forgets the penalties fails: its accepted drafts follow the unpenalized law."""
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.sampled.config import SampledGateOptions, parse_configs
    from specbench.suites.sampled.gate import run_gate

    opts = SampledGateOptions(num_prompts=1, positions=4, samples=256, permutations=999, prompt_chars=200,
                              prompt_set="echo,repeat", seed_repeat=0)
    cfgs = parse_configs("t=1,rp=1.5")
    assert cfgs[0].name == "t1-rp1.5" and cfgs[0].penalties() == {"repetition_penalty": 1.5}
    base = LocalAdapter.from_dirs(tiny_target, spec="off", name="baseline")
    out = {}
    try:
        for label, faults in (("clean", ()), ("fault", ("verify_ignores_penalties",))):
            cand = LocalAdapter.from_dirs(tiny_target, draft=tiny_draft, spec="dflash", name=label, faults=faults)
            try:
                out[label] = run_gate(base, cand, opts, cfgs)
            finally:
                cand.close()
    finally:
        base.close()
    assert out["clean"].verdict == "PASS", out["clean"].summary()
    assert out["fault"].verdict == "FAIL" and any(c.rejected for c in out["fault"].comparisons)


def test_penalties_judge_needs_token_ids_on_both_sides():
    """Text with an empty token list is no output to compare: CANNOT TEST, never identical (cannot_compare)."""
    from specbench.harness.adapters.base import GenResult
    from specbench.suites.lossless.gates.penalties import judge_penalized
    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt

    p, opts = Prompt("p", [1, 2]), GreedyGateOptions()
    empty = GenResult(rid="c", ok=True, text="hello", output_ids=[])
    pc = judge_penalized(p, empty, GenResult(rid="b", ok=True, text="hello", output_ids=[]), 8, opts)
    assert pc.status == "untestable" and pc.missing == "output token ids (candidate)"
    pc = judge_penalized(p, GenResult(rid="c", ok=True, output_ids=[5]), GenResult(rid="b", ok=False, error="x"), 8,
                         opts)
    assert pc.status == "error" and "baseline" in pc.reason
