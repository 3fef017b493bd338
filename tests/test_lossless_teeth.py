"""Gates with more teeth (#18 items 2, 4, 6): strict mode in fp32 and re-scoring that fails, two-sided acceptance
against recorded references, acceptance at concurrency N vs 1, EOS and stop token ids inside accepted runs.

Each rule: PASS on a clean input, FAIL on a constructed bad one, CANNOT TEST (or a skipped check) when the
evidence is missing; on fakes (tests/lossless_fakes.py) where possible, then end to end on the tiny pair."""

from __future__ import annotations

import asyncio
import json

import pytest
from lossless_fakes import FakeAdapter, V, dist
from typer.testing import CliRunner

from specbench.cli import app as cli
from specbench.harness.adapters.base import GenRequest, GenResult
from specbench.harness.results import open_run, read_reference
from specbench.suites.lossless import reference as accept_ref
from specbench.suites.lossless.checks import (
    AcceptanceEvidence,
    check_acceptance,
    compare_acceptance,
    fisher_p,
)
from specbench.suites.lossless.concurrent import run_concurrent
from specbench.suites.lossless.gates.common import stop_inside_run
from specbench.suites.lossless.gates.eos_in_run import eos_in_run, pick_stop_ids
from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt, check_output, resolve_rule
from specbench.suites.lossless.regret import STRICT_FP32_TOL
from specbench.suites.lossless.suite import LosslessConfig, run_lossless

cli._register()
runner = CliRunner()

PROMPT = Prompt("p", [5, 6, 7])
T = 12


class Fp32Fake(FakeAdapter):
    """A fake engine that declares its dtype (the strict-mode switch)."""

    def __init__(self, *a, dtype: str | None = "float32", **kw) -> None:
        super().__init__(*a, **kw)
        self.dtype = dtype

    def describe(self) -> dict:
        d = super().describe()
        d["config"] = {**d["config"], "dtype": self.dtype}
        return d


def greedy_at(length: int) -> list[int]:
    ids = list(PROMPT.ids)
    while len(ids) < length:
        d = dist(ids, {})
        ids.append(max(d, key=lambda x: (d[x], -x)))
    return ids


def alt_at(length: int) -> int:
    return ((3 * greedy_at(length)[-1] + 1) % V + 1) % V


def check(base, cand, opts: GreedyGateOptions):
    async def go():
        res = (await cand.generate([GenRequest(prompt=PROMPT.ids, max_tokens=T)]))[0]
        return await check_output(base, PROMPT, res, T, resolve_rule(opts, base, cand), cand)
    return asyncio.run(go())


# ---- strict mode ----------------------------------------------------------------------------------


def test_strict_mode_is_on_for_fp32_pairs_only():
    o = GreedyGateOptions()
    assert resolve_rule(o, Fp32Fake(), Fp32Fake()).rule == "strict"
    assert resolve_rule(o, Fp32Fake(), Fp32Fake()).tol == STRICT_FP32_TOL == 4e-4
    bf = resolve_rule(o, Fp32Fake(), Fp32Fake(dtype="bfloat16"))
    assert bf.rule == "margin" and bf.tol == 0.20 and "bfloat16" in bf.rule_reason
    unknown = resolve_rule(o, FakeAdapter(), FakeAdapter())
    assert unknown.rule == "margin" and "dtype=float32" in unknown.rule_reason
    assert resolve_rule(GreedyGateOptions(strict=True), FakeAdapter(), FakeAdapter()).rule == "strict"
    assert resolve_rule(GreedyGateOptions(strict=False), Fp32Fake(), Fp32Fake()).rule == "margin"


def test_strict_mode_fails_a_flip_the_margin_lets_pass():
    n = 5
    small = {n: 0.01}  # a 0.01-nat flip: a tie at the bf16 margin, no tie at fp32 noise
    margin = check(Fp32Fake(small, dtype="bfloat16"), Fp32Fake(small, picks={n: alt_at(n)}), GreedyGateOptions())
    assert margin.status == "flip"
    strict = check(Fp32Fake(small), Fp32Fake(small, picks={n: alt_at(n)}), GreedyGateOptions())
    assert strict.status == "fail" and "0.0004" in strict.reason
    tie = {n: 1e-4}  # within fp32 noise x10: benign in strict mode too
    ok = check(Fp32Fake(tie), Fp32Fake(tie, picks={n: alt_at(n)}), GreedyGateOptions())
    assert ok.status == "flip" and ok.divergences[0].judgement.margin_tol == STRICT_FP32_TOL


def test_strict_mode_cannot_test_without_baseline_logprobs():
    class NoLogprobs(Fp32Fake):
        async def generate_one(self, req):
            r = await super().generate_one(req)
            r.logprobs = None
            return r

        async def score(self, prompt_ids, continuation_ids, top_k=1):
            return None

    pc = check(NoLogprobs({5: 1e-4}), Fp32Fake({5: 1e-4}, picks={5: alt_at(5)}), GreedyGateOptions())
    assert pc.status == "untestable" and pc.missing == "baseline logprobs at the divergence"


def test_rescore_disagreement_fails_the_flip():
    n = 5
    # The baseline calls the flip a 0.05-nat tie; the candidate's own prefill puts its pick 3 nat below its top-1:
    # its verify path and its prefill path disagree.
    pc = check(FakeAdapter({n: 0.05}), FakeAdapter(picks={n: alt_at(n)}), GreedyGateOptions())
    d = pc.divergences[0]
    assert pc.status == "fail" and d.judgement.ok and d.rescore_fail and "prefill" in pc.reason
    # Re-scoring that agrees (same near-tie on both paths) leaves the flip benign.
    assert check(FakeAdapter({n: 0.05}), FakeAdapter({n: 0.05}, picks={n: alt_at(n)}), GreedyGateOptions()).ok
    # Strict: the candidate's prefill puts the pick 0.01 nat above the baseline's token, the baseline 1e-4 below
    # it: its own pick agrees, but two fp32 computations of one model differ by 0.0101 nat > 4e-4.
    pc = check(Fp32Fake({n: 1e-4}), Fp32Fake({n: -0.01}), GreedyGateOptions())
    assert pc.status == "fail" and "fp32 computations" in pc.divergences[0].rescore_fail
    # A candidate that cannot score: the flip stays benign (the report lists the re-scoring as not run).
    unscored = check(FakeAdapter({n: 0.05}), FakeAdapter(picks={n: alt_at(n)}, can_score=False),
                     GreedyGateOptions())
    assert unscored.status == "flip"


# ---- acceptance against a reference ----------------------------------------------------------------


def test_acceptance_is_two_sided():
    def ev(mean: float) -> AcceptanceEvidence:
        return AcceptanceEvidence("per-request", 100, 400, int(round((mean - 1) * 100)), [])

    assert check_acceptance(ev(3.0), 3.0).ok and check_acceptance(ev(3.15), 3.0).ok
    drop, rise = check_acceptance(ev(2.7), 3.0), check_acceptance(ev(3.3), 3.0)
    assert not drop.ok and "FELL" in drop.detail
    assert not rise.ok and "ROSE" in rise.detail and "[2.800, 3.200]" in rise.detail
    assert check_acceptance(ev(3.3), 3.0, two_sided=False).ok
    assert check_acceptance(ev(3.0), None).skipped


def test_fingerprint_ignores_label_and_faults():
    d = {"kind": "local", "model": "/x/target", "name": "a",
         "config": {"draft": "/x/draft", "spec": "dflash", "k": 7, "dtype": "float32", "device": "cpu",
                    "faults": [], "check_invariants": True, "num_pages": 64}}
    faulty = {**d, "name": "b", "config": {**d["config"], "faults": ["kv_offset"], "num_pages": 128}}
    k1, parts = accept_ref.fingerprint(d, [[1, 2, 3]], 64)
    assert k1 == accept_ref.fingerprint(faulty, [[1, 2, 3]], 64)[0]
    assert k1 != accept_ref.fingerprint(d, [[1, 2, 4]], 64)[0] != accept_ref.fingerprint(d, [[1, 2, 3]], 32)[0]
    assert k1 != accept_ref.fingerprint({**d, "config": {**d["config"], "dtype": "bfloat16"}}, [[1, 2, 3]], 64)[0]
    assert parts["max_tokens"] == 64 and parts["engine"]["k"] == 7 and "faults" not in parts["engine"]


class AcceptFake(FakeAdapter):
    """A fake whose per-request acceptance is `accepted` of 12 draft tokens (4 drafts)."""

    def __init__(self, accepted: int = 6, **kw) -> None:
        super().__init__(**kw)
        self.accepted = accepted

    async def generate_one(self, req):
        r = await super().generate_one(req)
        a = self.accepted
        r.spec = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": a,
                  "accepted_per_pos": [min(4, a), max(0, min(4, a - 4)), max(0, a - 8)]}
        return r


def _lossless(tmp_path, cand, **kw):
    cfg = LosslessConfig(num_prompts=4, max_tokens=8, results=str(tmp_path), **kw)

    async def go(run):
        return await run_lossless(FakeAdapter(), cand, cfg, run=run)

    with open_run("lossless", "1", results=tmp_path) as run:
        return asyncio.run(go(run))


def test_reference_recorded_then_used_and_a_rise_fails(tmp_path):
    first = _lossless(tmp_path, AcceptFake(6))
    assert first.verdict == "PASS" and first.reference["recorded"] and first.reference["used"] is None
    key = first.reference["key"]
    assert read_reference(accept_ref.KIND, key, tmp_path)["mean_accept_len"] == pytest.approx(2.5)
    again = _lossless(tmp_path, AcceptFake(6))
    acc = next(c for c in again.gates[0].checks if c.name == "acceptance")
    assert again.verdict == "PASS" and acc.ok and again.reference["used"] == pytest.approx(2.5)
    assert "recorded reference" in again.reference["source"] and not again.reference["recorded"]
    rose = _lossless(tmp_path, AcceptFake(9))  # 3.25 vs 2.5: acceptance rose without cause
    acc = next(c for c in rose.gates[0].checks if c.name == "acceptance")
    assert rose.verdict == "FAIL" and not acc.ok and "ROSE" in acc.detail
    assert read_reference(accept_ref.KIND, key, tmp_path)["mean_accept_len"] == pytest.approx(2.5)  # kept
    off = _lossless(tmp_path, AcceptFake(9), accept_reference=False)
    assert off.verdict == "PASS" and all(c.name != "acceptance" for c in off.gates[0].checks)
    replaced = _lossless(tmp_path, AcceptFake(9), accept_reference=True, record_reference=True,
                         expect_accept_len=3.25)
    assert replaced.verdict == "PASS" and replaced.reference["recorded"]
    assert read_reference(accept_ref.KIND, key, tmp_path)["mean_accept_len"] == pytest.approx(3.25)


# ---- acceptance at concurrency N vs 1 -----------------------------------------------------------------


def _res(rid: str, drafted: int, accepted: int) -> GenResult:
    return GenResult(rid, True, output_ids=[1], spec={"num_drafts": drafted // 4, "num_draft_tokens": drafted,
                                                      "num_accepted_tokens": accepted})


def test_compare_acceptance_rule():
    same = compare_acceptance([_res("a", 400, 200)], [_res("a", 400, 200)], None, None, "c8 vs c1")
    assert same.source == "per-request" and same.p_value == 1.0 and same.check().ok
    drop = compare_acceptance([_res("a", 400, 120), _res("b", 400, 130)], [_res("a", 400, 200), _res("b", 400, 210)],
                              None, None, "c8 vs c1", [64, 32])
    assert drop.failed and drop.p_value < 1e-6 and "DROPPED" in drop.describe() and not drop.check().ok
    assert drop.per_request[1] == {"rid": "b", "max_tokens": 32, "test_drafted": 400, "test_accepted": 130,
                                   "ref_drafted": 400, "ref_accepted": 210}
    rise = compare_acceptance([_res("a", 400, 260)], [_res("a", 400, 200)], None, None, "c8 vs c1")
    assert rise.failed and "ROSE" in rise.describe()
    small = compare_acceptance([_res("a", 40, 22)], [_res("a", 40, 20)], None, None, "c8 vs c1")
    assert not small.failed and small.p_value > 0.5  # a couple of tokens either way is no evidence
    bare = [GenResult("a", True, output_ids=[1])]
    counters = compare_acceptance(bare, bare, {"num_draft_tokens": 400, "num_accepted_tokens": 100},
                                  {"num_draft_tokens": 400, "num_accepted_tokens": 200}, "c8 vs c1")
    assert counters.source == "counters" and counters.failed
    none = compare_acceptance(bare, bare, None, None, "c8 vs c1")
    assert none.source == "none" and none.check().skipped


def test_a_few_draft_rounds_are_no_evidence():
    """One fully accepted round of 7 against a 0.35 rate over 144 draft tokens is p ~ 1e-3 to a token-level test
    (seen under a max-batch gate at concurrency, which drafts only at a request's tail), but one observation: with
    the rounds reported, fewer than ACCEPT_MIN_ROUNDS in an arm is skipped and says why; the same shift over
    enough rounds still fails, and counters' num_drafts count the same way."""
    def res(rid, rounds, drafted, accepted):
        return GenResult(rid, True, output_ids=[1], spec={"num_drafts": rounds, "num_draft_tokens": drafted,
                                                          "num_accepted_tokens": accepted})

    one = compare_acceptance([res("a", 1, 7, 7), res("b", 0, 0, 0)], [res("a", 12, 70, 25), res("b", 11, 74, 26)],
                             None, None, "c6 vs c1")
    assert one.test_rounds == 1 and one.ref_rounds == 23 and one.too_few_rounds
    assert not one.failed and one.check().skipped and "fewer than the 8 a verdict needs" in one.describe()
    assert fisher_p(7, 7, 51, 144) < 1e-3  # what the token-level test alone said
    many = compare_acceptance([res("a", 40, 280, 240)], [res("a", 40, 280, 100)], None, None, "c6 vs c1")
    assert many.test_rounds == 40 and many.failed and "ROSE" in many.describe()
    unknown = compare_acceptance([_res("a", 400, 260)], [_res("a", 400, 200)], None, None, "c8 vs c1")
    assert unknown.failed  # _res reports 100 rounds
    bare = [GenResult("a", True, output_ids=[1])]
    few = compare_acceptance(bare, bare, {"num_drafts": 2, "num_draft_tokens": 14, "num_accepted_tokens": 14},
                             {"num_drafts": 30, "num_draft_tokens": 200, "num_accepted_tokens": 60}, "c8 vs c1")
    assert few.source == "counters" and few.too_few_rounds and few.check().skipped


class BatchFake(AcceptFake):
    """Acceptance that drops only when requests share a batch (the batched_draft_pos class)."""

    async def generate(self, requests, concurrency=None, on_result=None, offsets=None):
        self.accepted = 6 if concurrency == 1 or len(requests) == 1 else 1
        return await super().generate(requests, concurrency, on_result, offsets)


class Silent(FakeAdapter):
    async def generate_one(self, req):
        r = await super().generate_one(req)
        r.spec = None
        return r


def _concurrent(cand) -> object:
    ps = [Prompt(f"q{i}", [5 + i, 6, 7]) for i in range(6)]
    return asyncio.run(run_concurrent(FakeAdapter(), cand, ps, 12, GreedyGateOptions()))


def test_concurrent_gate_compares_acceptance_with_c1():
    ok = _concurrent(AcceptFake(6))
    assert ok.verdict == "PASS" and ok.acceptance.source == "per-request" and ok.acceptance.p_value == 1.0
    bad = _concurrent(BatchFake())
    acc = next(c for c in bad.checks if c.name == "acceptance-vs-c1")
    assert bad.verdict == "FAIL" and not acc.ok and "DROPPED" in acc.detail
    blind = _concurrent(Silent())  # no per-request counts, no counters: the comparison cannot be made
    assert blind.verdict == "CANNOT TEST" and any("per-request draft counts" in m for m in blind.missing)


# ---- EOS and stop token ids inside accepted runs ----------------------------------------------------------


def test_pick_stop_ids_and_inside_detection():
    ids = [3, 4, 3, 5, 6, 7, 8, 9, 10, 11, 12]
    picks = pick_stop_ids(ids, {9})
    assert picks == [(3, 5), (6, 8)] and all(ids.index(t) == p for p, t in picks)
    assert all(p % 4 for p, _ in pick_stop_ids(ids, set(), k=3))  # never a bonus position of K = 3
    # One chunk per step: [prefill 1 token][step 1: 4 tokens][step 2: 2 tokens, cut by the stop]
    r = GenResult("a", True, output_ids=list(range(7)), chunk_tokens=[1, 4, 2], spec={"accepted_runs": [3, 3]})
    assert stop_inside_run(r, 6, None) is True  # offset 1 of a run of 3 accepted drafts
    r2 = GenResult("a", True, output_ids=list(range(5)), chunk_tokens=[1, 4], spec={"accepted_runs": [3]})
    assert stop_inside_run(r2, 4, None) is False  # the bonus token: nothing accepted past it
    bare = GenResult("a", True, output_ids=list(range(5)))
    assert stop_inside_run(bare, 4, {"num_drafts": 2, "num_accepted_tokens": 5}) is True  # 5 < 1 + 2 + 5
    assert stop_inside_run(bare, 4, {"num_drafts": 1, "num_accepted_tokens": 3}) is False
    assert stop_inside_run(bare, 4, None) is None


class StopFake(FakeAdapter):
    """Honours stop_token_ids; every step 'accepts' K = 3 drafts (one chunk per step, as the local engine streams);
    `overrun`: a stop inside a run is honoured only at the run's end (the eos_in_run class)."""

    K = 3

    def __init__(self, overrun: bool = False, runs: bool = True, honour: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.overrun, self.runs, self.honour = overrun, runs, honour

    async def generate_one(self, req):
        r = await super().generate_one(req)
        ids = list(r.output_ids or [])
        chunks = [1] + [self.K + 1] * ((len(ids) - 1) // (self.K + 1))
        if sum(chunks) < len(ids):
            chunks.append(len(ids) - sum(chunks))
        stops = set(req.stop_token_ids) if self.honour else set()
        hit = next((i for i, t in enumerate(ids) if t in stops), None)
        if hit is not None:
            end = hit + 1
            if self.overrun:  # the end of the chunk that holds the stop
                end = next(s for s in (sum(chunks[:j + 1]) for j in range(len(chunks))) if s > hit)
            ids, r.finish_reason = ids[:end], "stop"
            while sum(chunks) > len(ids):
                chunks[-1] -= sum(chunks) - len(ids)
                if chunks[-1] <= 0:
                    chunks.pop()
        r.output_ids, r.completion_tokens, r.chunk_tokens = ids, len(ids), chunks
        r.chunk_times = [0.0] * len(chunks)
        if r.logprobs is not None:
            r.logprobs = r.logprobs[:len(ids)]
        r.spec = {"num_drafts": len(chunks) - 1, "num_draft_tokens": self.K * (len(chunks) - 1),
                  "num_accepted_tokens": self.K * (len(chunks) - 1), "accepted_runs": [self.K] * (len(chunks) - 1)} \
            if self.runs else None
        return r


def _eos(cand, base=None):
    ps = [Prompt("a", [5, 6, 7]), Prompt("b", [9, 2])]
    return asyncio.run(eos_in_run(base or StopFake(), cand, ps, 16, GreedyGateOptions()))


def test_eos_in_run_passes_on_a_clean_engine():
    eos_b = {9: 1}  # "a" ends at its 6th token, "b" at its 7th, with finish "stop" (EOS, inside the second run)
    g = _eos(StopFake(stop_at=eos_b), base=StopFake(stop_at=eos_b))
    assert g.verdict == "PASS", (g.missing, [p.reason for p in g.prompts])
    ev = g.evidence["stop_inside_run"]
    assert ev["drafter stop-id"]["cases"] >= 2 and ev["drafter stop-id"]["inside"] >= 1
    assert ev["drafter eos"] == {"inside": 2, "known": 2, "cases": 2}


def test_eos_in_run_fails_an_overrun_and_a_miscount():
    g = _eos(StopFake(overrun=True))
    assert g.verdict == "FAIL" and any("past the stop id" in p.reason for p in g.prompts)

    class Miscount(StopFake):
        async def generate_one(self, req):
            r = await super().generate_one(req)
            r.completion_tokens = len(r.output_ids or []) + 2  # usage counts tokens it did not return
            return r

    g = _eos(Miscount())
    assert g.verdict == "FAIL" and any("completion_tokens" in p.reason for p in g.prompts)


def test_eos_in_run_cannot_test_without_evidence():
    g = _eos(StopFake(runs=False))  # no per-step runs, no counters: nothing shows a stop inside a run
    assert g.verdict == "CANNOT TEST" and any("inside an accepted run" in m for m in g.missing)
    # A baseline that ignores stop_token_ids: its cases are dropped (a skipped check says so), none is left.
    g = _eos(StopFake(honour=False), base=StopFake(honour=False))
    assert g.verdict == "CANNOT TEST" and any("a stop to test" in m for m in g.missing)
    assert any(c.name == "stop-token-ids" and c.skipped for c in g.checks)


# ---- end to end on the tiny pair --------------------------------------------------------------------------


def test_oracle_engine_counts_only_returned_tokens(tiny_pair):
    """The oracle capability forces a stop id inside an accepted run; the chunks carry exactly the returned
    ids (a step used to report its whole run as new tokens)."""
    from specbench.harness.adapters.local import LocalAdapter

    base = LocalAdapter.from_dirs(tiny_pair[0], spec="off", num_pages=64)
    cand = LocalAdapter.from_dirs(tiny_pair[0], draft=tiny_pair[1], spec="dflash", num_pages=64)

    async def go():
        ids = await base.tokenize("Question: Tom has 3 apples and buys 5 more. How many now?\nAnswer:")
        full = (await base.generate([GenRequest(prompt=ids, max_tokens=32)]))[0]
        oracle = cand.with_oracle_drafts({tuple(ids): full.output_ids})
        try:
            stop = next(t for i, t in enumerate(full.output_ids) if i >= 10 and full.output_ids.index(t) == i)
            r = (await oracle.generate([GenRequest(prompt=ids, max_tokens=32, stop_token_ids=(stop,))]))[0]
        finally:
            await oracle.aclose()
        return full, stop, r

    try:
        full, stop, r = asyncio.run(go())
    finally:
        base.close()
        cand.close()
    pos = full.output_ids.index(stop)
    assert r.output_ids == full.output_ids[:pos + 1] and r.finish_reason == "stop"
    assert sum(r.chunk_tokens) == len(r.output_ids) == r.completion_tokens
    assert max(r.spec["accepted_runs"]) == cand.engine.k  # every draft accepted


def test_lossless_with_every_gate_passes_on_the_tiny_pair(tiny_pair, tmp_path):
    t, d = tiny_pair
    res = runner.invoke(cli.app, ["lossless", "--baseline", f"local:{t},spec=off", "--candidate",
                                  f"local:{t},draft={d},spec=dflash", "--num-prompts", "4", "--max-tokens", "32",
                                  "--concurrent", "--engine-gates", "--json", "--results", str(tmp_path)])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.exit_code == 0, res.output
    gates = {g["name"]: g for g in out["gates"]}
    assert out["summary"]["rule"]["mode"] == "strict" and out["summary"]["rule"]["tol"] == STRICT_FP32_TOL
    assert gates["greedy"]["rule"]["mode"] == "strict"
    acc = gates["concurrent"]["acceptance"]
    assert acc["source"] == "per-request" and not acc["failed"] and acc["test_drafted"] > 0
    ev = gates["eos-in-run"]["evidence"]["stop_inside_run"]
    assert gates["eos-in-run"]["verdict"] == "PASS" and sum(v["inside"] for v in ev.values()) > 0
    assert ev["oracle stop-id"]["inside"] >= 1
    assert out["summary"]["reference"]["recorded"]


def test_eos_in_run_catches_the_fault_on_the_tiny_pair(tiny_pair):
    t, d = tiny_pair
    res = runner.invoke(cli.app, ["lossless", "--baseline", f"local:{t},spec=off", "--candidate",
                                  f"local:{t},draft={d},spec=dflash,faults=eos_in_run", "--num-prompts", "3",
                                  "--max-tokens", "32", "--engine-gates", "--json", "--no-record",
                                  "--no-accept-reference"])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    gates = {g["name"]: g for g in out["gates"]}
    assert res.exit_code == 1 and gates["eos-in-run"]["verdict"] == "FAIL"
    assert any("past the" in p["reason"] for p in gates["eos-in-run"]["prompts"] if not p["ok"])
