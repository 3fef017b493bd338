"""Logprobs under speculation: the bundled engine speculates logprobs requests (SpecConfig.logprobs), and the
mixed gate's logprobs-parity check holds a candidate's returned logprobs to the baseline's.

- checks.logprob_parity on constructed results: equal logprobs pass; one position late (the row-offset bug) fails
  at most positions; the bf16 margin lets a few positions of noise through, never a gross one; strict mode none;
  positions the candidate left without a logprob are counted, not compared;
- the engine (fp32, CPU, tiny pair): a speculating logprobs request returns the plain engine's logprobs (greedy),
  and a sampled one the plain engine's teacher-forced logprobs of the same tokens; the switch off restores the
  one-token path;
- the mixed gate end to end: PASS on the clean engine with the logprobs requests speculating, FAIL with the
  `spec_logprobs_late` fault armed (only the logprobs change there: every token stays lossless)."""

from __future__ import annotations

import asyncio

import pytest

from specbench.engine import LLM, SamplingParams
from specbench.harness.adapters.base import GenResult, PosLogprobs
from specbench.suites.lossless.checks import LOGPROB_GROSS, check_logprob_parity, logprob_parity

N = 24


def _result(ids: list[int], rows: list[dict[int, float]], rid: str = "r") -> GenResult:
    lps = [PosLogprobs(t, row[t], dict(sorted(row.items(), key=lambda kv: -kv[1])[:3])) for t, row in zip(ids, rows,
                                                                                                           strict=True)]
    return GenResult(rid=rid, ok=True, output_ids=list(ids), logprobs=lps)


def _rows(n: int) -> tuple[list[int], list[dict[int, float]]]:
    """n positions, each a distinct 5-token distribution whose top token is the chosen one."""
    ids, rows = [], []
    for i in range(n):
        toks = [(7 * i + j) % 50 for j in range(5)]
        vals = [-0.1 - 0.05 * (i % 3), -2.5 - 0.1 * i, -3.0 - 0.2 * (i % 4), -4.0, -5.5]
        ids.append(toks[0])
        rows.append(dict(zip(toks, vals, strict=True)))
    return ids, rows


def test_equal_logprobs_pass_in_both_modes():
    ids, rows = _rows(20)
    p = logprob_parity(_result(ids, rows), _result(ids, rows), 3, 4e-4)
    assert p.compared == 20 and not p.over and p.worst == 0.0
    assert check_logprob_parity([("r", p)], 4e-4, strict=True).ok


def test_one_position_late_fails():
    ids, rows = _rows(20)
    late = [*rows[1:], rows[-1]]  # token j reported with row j + 1's logprobs
    lps = [PosLogprobs(t, r.get(t, -9.0), dict(sorted(r.items(), key=lambda kv: -kv[1])[:3]))
           for t, r in zip(ids, late, strict=True)]
    cand = GenResult(rid="c", ok=True, output_ids=ids, logprobs=lps)
    p = logprob_parity(cand, _result(ids, rows), 3, 0.2)
    assert len(p.over) >= 18 and p.worst > 1.0
    c = check_logprob_parity([("c", p)], 0.2, strict=False)
    assert not c.ok and "position" in c.detail


def test_margin_mode_lets_a_little_noise_through_but_not_a_gross_error():
    ids, rows = _rows(40)
    noisy = [dict(r) for r in rows]
    noisy[5][ids[5]] += 0.3  # one position 1.5 tolerances off: bf16 noise at a near tie
    p = logprob_parity(_result(ids, noisy), _result(ids, rows), 3, 0.2)
    assert len(p.over) == 1
    assert check_logprob_parity([("r", p)], 0.2, strict=False).ok  # 1 of 40 <= 5 %
    assert not check_logprob_parity([("r", p)], 0.2, strict=True).ok  # strict: none
    noisy[9][ids[9]] += 0.2 * LOGPROB_GROSS + 0.1
    p = logprob_parity(_result(ids, noisy), _result(ids, rows), 3, 0.2)
    assert not check_logprob_parity([("r", p)], 0.2, strict=False).ok


def test_a_top_token_missing_from_the_candidate_list_is_an_error():
    ids, rows = _rows(10)
    cand = _result(ids, rows)
    t = ids[4]
    other = [k for k in rows[4] if k != t][0]  # the candidate's list loses the baseline's second token
    cand.logprobs[4].top = {t: rows[4][t], 99: -3.1, 98: -3.2}
    assert other not in cand.logprobs[4].top
    p = logprob_parity(cand, _result(ids, rows), 3, 0.2)
    assert p.over == [4] and "missing" in p.problems[0]


def test_missing_positions_are_counted_and_the_prefix_ends_at_the_first_divergence():
    ids, rows = _rows(12)
    cand = _result(ids, rows)
    cand.logprobs[3] = PosLogprobs(ids[3], None)  # llama.cpp: no logprob for a draft-accepted token
    cand.output_ids = ids[:8] + [49, 48, 47, 46]
    p = logprob_parity(cand, _result(ids, rows), 3, 4e-4)
    assert p.missing == 1 and p.compared == 7
    none = logprob_parity(GenResult(rid="x", ok=True, output_ids=ids, logprobs=None), _result(ids, rows), 3, 0.2)
    assert check_logprob_parity([("x", none)], 0.2, strict=False).skipped


def test_an_entry_naming_another_token_fails():
    ids, rows = _rows(6)
    cand = _result(ids, rows)
    cand.logprobs[2].token_id = ids[3]
    p = logprob_parity(cand, _result(ids, rows), 3, 0.2)
    assert p.over == [2] and "names token" in p.problems[0]


# ---- the engine ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_draft):
    plain = LLM(tiny_target, num_pages=256)
    spec = LLM(tiny_target, draft=tiny_draft, num_pages=256)
    yield plain, spec
    plain.close()
    spec.close()


def test_speculated_logprobs_equal_the_plain_engines(engines, gsm8k_prompts):
    plain, spec = engines
    prompts = gsm8k_prompts[:4]
    sp = SamplingParams(max_tokens=N, ignore_eos=True, logprobs=3)
    want, got = plain.generate(prompts, sp), spec.generate(prompts, sp)
    assert sum(o.spec["num_drafts"] for o in got) > 0
    assert any(max(o.spec["accepted_runs"] or [0]) > 0 for o in got), "no draft accepted: the run path untested"
    for w, g in zip(want, got, strict=True):
        assert g.output_ids == w.output_ids and len(g.logprobs) == N
        for (wl, wt), (gl, gt) in zip(w.logprobs, g.logprobs, strict=True):
            assert abs(wl - gl) < 1e-4 and wt.keys() == gt.keys()
            assert max(abs(wt[t] - gt[t]) for t in wt) < 1e-4


def test_sampled_speculated_logprobs_are_the_targets_of_the_drawn_tokens(engines, gsm8k_prompts):
    """Sampled: the tokens differ from any plain run, so the plain engine scores the drawn tokens (prompt
    logprobs of prompt + output): each returned logprob must be that raw target logprob."""
    plain, spec = engines
    prompt = gsm8k_prompts[0]
    out = spec.generate([prompt], SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.8, seed=3,
                                                 logprobs=2))[0]
    assert out.spec["num_drafts"] > 0
    ids = plain.engine.tokenizer.encode(prompt)
    scored = plain.generate([ids + out.output_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ref = [e[0] for e in scored.prompt_logprobs[len(ids):]]
    assert len(ref) == N
    assert max(abs(a - b[0]) for a, b in zip(ref, out.logprobs, strict=True)) < 1e-4


def test_the_switch_off_runs_logprobs_requests_unspeculated(tiny_target, tiny_draft, gsm8k_prompts, monkeypatch):
    monkeypatch.setenv("SPECBENCH_SPEC_LOGPROBS", "0")
    off = LLM(tiny_target, draft=tiny_draft, num_pages=256)
    try:
        sp = [SamplingParams(max_tokens=N, ignore_eos=True, logprobs=2 if i % 2 else None) for i in range(4)]
        outs = off.generate(gsm8k_prompts[:4], sp)
        assert [o.spec["num_drafts"] == 0 for o in outs] == [False, True, False, True]
        assert off.engine.describe()["spec_logprobs"] is False
    finally:
        off.close()


# ---- the mixed gate ------------------------------------------------------------------------------------------


def _mixed(tiny_target, tiny_draft, gsm8k_prompts, faults: tuple[str, ...]):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
    from specbench.suites.lossless.registry import GATES

    base = LocalAdapter.from_dirs(tiny_target, spec="off", num_pages=256, name="baseline")
    cand = LocalAdapter.from_dirs(tiny_target, draft=tiny_draft, spec="dflash", num_pages=256, name="cand",
                                  faults=faults)
    try:
        prompts = [Prompt(f"p{i}", base.engine.tokenizer.encode(p)) for i, p in enumerate(gsm8k_prompts[:4])]
        return asyncio.run(GATES["mixed"](base, cand, prompts, N, GreedyGateOptions()))
    finally:
        base.close()
        cand.close()


def test_mixed_gate_passes_with_speculated_logprobs(tiny_target, tiny_draft, gsm8k_prompts):
    run = _mixed(tiny_target, tiny_draft, gsm8k_prompts, ())
    checks = {c.name: c for c in run.checks}
    assert run.verdict == "PASS", [c.to_dict() for c in run.checks]
    assert checks["logprobs-parity"].ok and not checks["logprobs-parity"].skipped
    assert not checks["logprobs-speculate"].skipped and "drafted" in checks["logprobs-speculate"].detail


def test_mixed_gate_fails_logprobs_one_position_late(tiny_target, tiny_draft, gsm8k_prompts):
    run = _mixed(tiny_target, tiny_draft, gsm8k_prompts, ("spec_logprobs_late",))
    checks = {c.name: c for c in run.checks}
    assert run.verdict == "FAIL"
    assert not checks["logprobs-parity"].ok, checks["logprobs-parity"].detail
    assert all(pc.status in ("identical", "flip") for pc in run.prompts)  # the tokens stayed lossless


def test_drafted_reads_tokens_or_rounds():
    """llama.cpp reports draft tokens per request (timings), not rounds: the mixed gate's neighbours-speculate read
    num_drafts alone and failed every llama-server run (tests/foreign: test_mixed_gate_logprobs_parity)."""
    def r(spec):
        return GenResult(rid="x", ok=True, spec=spec)

    assert r({"num_draft_tokens": 63, "num_accepted_tokens": 12}).drafted == 63
    assert r({"num_drafts": 4}).drafted == 4
    assert r({"num_drafts": 0, "num_draft_tokens": 0}).drafted == 0
    assert r(None).drafted is None and r({"source": "timings"}).drafted is None
