"""Each verdict about its own subject, with evidence, and the rule applied is the rule stated (issue #45 item 4).

- No token from an endpoint is CANNOT TEST in every gate, each with its one true reason (not the mixed gate's FAIL
  "missing logprobs" for requests that returned nothing).
- A PASS needs evidence that the candidate speculated (spec counters, per-request draft counts, streamed chunks of
  several tokens); none is CANNOT TEST, or "PASS (speculation asserted by the user, not observed)" with
  --assume-speculating; counters that show zero drafts stay NOT SPECULATING.
- Several sampled candidates: each is its own BH family (at q / k), so one candidate's failure never marks another.
- The tolerance typed is the tolerance applied (strict fp32 exactness only where none is typed), and every verdict
  line, report and record says which judged each gate, and why.
- Each CANNOT TEST names the reason that is true (the headroom gate: no local geometry, nothing else).

On fakes (tests/lossless_fakes.py, tests/dialect_fakes.py over HTTP, the sampled gate's FakeEngine), then on the
tiny pair where a fault is needed. CPU only."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
from dialect_fakes import FakeServer, serving
from lossless_fakes import FakeAdapter
from typer.testing import CliRunner

from specbench.cli import app as cli
from specbench.harness.adapters.base import GenRequest, GenResult
from specbench.harness.results import open_run
from specbench.harness.verdicts import (
    CANNOT_TEST,
    EXIT_CANNOT_TEST,
    EXIT_FAIL,
    EXIT_OK,
    NO_SPEC_EVIDENCE,
    NOT_SPECULATING,
    PASS,
    PASS_ASSERTED,
    exit_code,
    speculation_verdict,
)
from specbench.suites.lossless.checks import AcceptanceEvidence, acceptance_evidence, counted_exactly
from specbench.suites.lossless.gates.headroom import headroom
from specbench.suites.lossless.gates.min_tokens import min_tokens
from specbench.suites.lossless.gates.mixed import mixed
from specbench.suites.lossless.gates.stop_in_run import stop_in_run
from specbench.suites.lossless.greedy import (
    GreedyGateOptions,
    LosslessError,
    Prompt,
    resolve_rule,
    run_greedy,
)
from specbench.suites.lossless.outcomes import NO_OUTPUT
from specbench.suites.lossless.report import render_console, render_markdown
from specbench.suites.lossless.suite import LosslessConfig, run_lossless

cli._register()
runner = CliRunner()
PROMPTS = [Prompt(f"q{i}", [5 + i, 6, 7]) for i in range(3)]


def _cli(*args):
    res = runner.invoke(cli.app, [str(a) for a in args])
    doc = json.loads(res.stdout.strip().splitlines()[-1]) if "--json" in args and res.stdout.strip() else None
    return res, doc


def _lossless(url: str, *extra):
    return _cli("lossless", "--baseline", f"openai:{url}", "--candidate", f"openai:{url}", "--num-prompts", 2,
                "--max-tokens", 6, "--no-record", "--json", *extra)


def _sampled(url: str, *extra):
    return _cli("sampled", "--baseline", f"openai:{url}", "--candidate", f"openai:{url}", "--num-prompts", 1,
                "--positions", 3, "--samples", 48, "--configs", "t=1.0", "--permutations", 99, "--seed-repeat", 0,
                "--no-record", "--json", *extra)


# ---- 1. no token from an endpoint: CANNOT TEST in every gate, each with its one true reason ---------------------

# Each gate's one reason on an endpoint that yields no token (but claims ids and logprobs): what the gate could not
# collect, first-hand. Gates that send candidate requests: every output was empty; the others: what they needed
# from the baseline's (empty) outputs, or the local geometry.
EMPTY_REASONS = {
    "greedy": NO_OUTPUT, "short-then-long": NO_OUTPUT, "concurrent": NO_OUTPUT, "mixed": NO_OUTPUT,
    "abort-in-flight": NO_OUTPUT, "penalties": NO_OUTPUT, "logit-bias": NO_OUTPUT, "long-context": NO_OUTPUT,
    "stop-in-run": "a stop string to test: no baseline output of 2 prompts had text to pick one from",
    "eos-in-run": "a stop to test: no baseline output ended early at EOS and no stop id could be picked from one",
    "min-tokens": "a stop token: the baseline's output was empty or all EOS",
    "headroom": "the model geometry (max_position_embeddings and the usable context), which only a local engine "
                "gives: no request was sent",
    "prefix-cache": NO_OUTPUT,
    "levers": "the engine's load-aware levers (the adapter capability \"levers\": gate, trim, policy), which only a "
              "local engine sets: no request was sent",
    "accept-trace": "the acceptance trace needs a drafter the replay can run (DFlash, DFlash2 or n-gram, with its "
                    "checkpoints), which only a local engine names (an endpoint: --replay-drafter): no request was "
                    "sent",
    "near-ties": "the adapter capability \"oracle_drafts\" (a local engine whose drafts replay a given continuation): "
                 "no request was sent",
}


def test_an_endpoint_that_yields_no_token_is_cannot_test_in_every_gate():
    with serving(FakeServer("vllm", empty=True, metrics=False)) as url:
        res, doc = _lossless(url)
    assert res.exit_code == EXIT_CANNOT_TEST and doc["verdict"] == CANNOT_TEST, res.output
    gates = {g["name"]: g for g in doc["gates"]}
    assert set(gates) == set(EMPTY_REASONS)
    for name, g in gates.items():  # no FAIL anywhere, and the one reason that is true
        assert g["verdict"] == CANNOT_TEST and g["missing"] == [EMPTY_REASONS[name]], (name, g["missing"])
    lp = next(c for c in gates["mixed"]["checks"] if c["name"] == "logprobs-returned")
    assert lp["skipped"] and lp["ok"] and "returned no ids or no token" in lp["detail"]
    assert doc["summary"]["missing"] == [f"greedy: {NO_OUTPUT}"]
    # the healthy endpoint, same shape (ids, logprobs, counters), every gate with evidence: PASS
    with serving(FakeServer("vllm", spec=True)) as url:
        ok, doc = _lossless(url, "--quick", "--concurrent")
    assert ok.exit_code == EXIT_OK and doc["verdict"] == PASS, ok.output


class NoLogprobs(FakeAdapter):
    """Tokens, but no logprobs for a request that asked for them (a broken endpoint); `empty`: no token at all."""

    def __init__(self, empty: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.empty = empty

    async def generate_one(self, req: GenRequest) -> GenResult:
        r = await super().generate_one(req)
        if self.empty:
            r.output_ids, r.completion_tokens, r.logprobs = [], 0, []
        elif req.logprobs is not None:
            r.logprobs = None
        return r


def test_the_mixed_gate_fails_missing_logprobs_only_where_tokens_came_back():
    opts = GreedyGateOptions()
    broken = asyncio.run(mixed(FakeAdapter(), NoLogprobs(), PROMPTS, 8, opts))
    chk = next(c for c in broken.checks if c.name == "logprobs-returned")
    assert broken.verdict == "FAIL" and not chk.ok and "missing logprobs" in chk.detail
    nothing = asyncio.run(mixed(NoLogprobs(empty=True), NoLogprobs(empty=True), PROMPTS, 8, opts))
    chk = next(c for c in nothing.checks if c.name == "logprobs-returned")
    assert chk.skipped and nothing.verdict == CANNOT_TEST and nothing.missing == [NO_OUTPUT]
    healthy = asyncio.run(mixed(FakeAdapter(), FakeAdapter(), PROMPTS, 8, opts))
    assert healthy.verdict == PASS and next(c for c in healthy.checks if c.name == "logprobs-returned").ok


# ---- 2. no evidence that the candidate speculated --------------------------------------------------------------


def _res(spec: dict | None = None, chunks: list[int] | None = None, method: str = "token_ids") -> GenResult:
    n = sum(chunks) if chunks else 4
    return GenResult("r", True, output_ids=[1] * n, spec=spec, chunk_tokens=list(chunks or [1] * n),
                     token_count_method=method)


def test_speculation_evidence_sources_in_order():
    per = acceptance_evidence([_res({"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 4})], None)
    assert per.source == "per-request" and per.speculating
    ctr = acceptance_evidence([_res()], {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 6})
    assert ctr.source == "counters" and ctr.speculating
    zero = acceptance_evidence([_res(chunks=[1, 2, 2])], {"num_drafts": 0, "num_draft_tokens": 0,
                                                          "num_accepted_tokens": 0}, assumed=True)
    assert zero.source == "counters" and zero.speculating is False  # counters decide, the user's word does not
    llama = acceptance_evidence([_res({"num_draft_tokens": 6, "num_accepted_tokens": 3})], None)
    assert llama.source == "per-request draft tokens" and llama.speculating
    idle = acceptance_evidence([_res({"num_draft_tokens": 0, "num_accepted_tokens": 0})], None)
    assert idle.speculating is False and idle.describe().startswith("NOT SPECULATING")
    chunks = acceptance_evidence([_res(chunks=[1, 2, 1, 2])], None)
    assert chunks.source == "stream chunks" and chunks.multi_token_chunks == 2 and chunks.speculating
    # no evidence: single-token chunks, estimated counts, a non-streamed answer (one chunk by construction)
    for r in (_res(chunks=[1, 1, 1]), _res(chunks=[1, 3], method="proportional"), _res(chunks=[6])):
        ev = acceptance_evidence([r], None)
        assert ev.source == "none" and ev.speculating is None and "no evidence" in ev.describe()
    assumed = acceptance_evidence([_res()], None, assumed=True)
    assert assumed.speculating is None and "asserted by the user" in assumed.describe()
    assert counted_exactly("logprobs+token_ids") and not counted_exactly("chunks") and not counted_exactly(None)
    assert [speculation_verdict(x, a) for x, a in ((True, False), (False, True), (None, False), (None, True))] == \
        [PASS, NOT_SPECULATING, CANNOT_TEST, PASS_ASSERTED]
    assert [exit_code(v) for v in (PASS_ASSERTED, NOT_SPECULATING, CANNOT_TEST)] == [EXIT_OK, EXIT_FAIL,
                                                                                        EXIT_CANNOT_TEST]


class Silent(FakeAdapter):
    """No per-request spec, no counters; streamed chunks of `chunk` tokens each (counted exactly)."""

    def __init__(self, chunk: int = 1, **kw) -> None:
        super().__init__(**kw)
        self.chunk = chunk

    async def generate_one(self, req: GenRequest) -> GenResult:
        r = await super().generate_one(req)
        n = len(r.output_ids or [])
        r.spec, r.token_count_method = None, "token_ids"
        rest = n - 1  # the prefill's token alone, then steps of `chunk` tokens
        r.chunk_tokens = [1] + [self.chunk] * (rest // self.chunk) + ([rest % self.chunk] if rest % self.chunk else [])
        return r


def _greedy(cand, **kw):
    return asyncio.run(run_greedy(FakeAdapter(), cand, PROMPTS, 8, GreedyGateOptions(**kw)))


def test_a_pass_needs_evidence_that_the_candidate_speculated():
    blind = _greedy(Silent())
    assert blind.verdict == CANNOT_TEST and blind.missing == [NO_SPEC_EVIDENCE]
    asserted = _greedy(Silent(), assume_speculating=True)
    assert asserted.verdict == PASS_ASSERTED and asserted.missing == []
    seen = _greedy(Silent(chunk=2))  # one step emitted two tokens: speculation, seen in the stream
    assert seen.verdict == PASS and seen.stats.source == "stream chunks"
    assert _greedy(FakeAdapter()).verdict == PASS  # per-request verify steps


def test_no_evidence_end_to_end_lossless_quick_and_sampled():
    with serving(FakeServer("vllm", metrics=False)) as url:  # never speculates, no counters, same ids on both arms
        full, doc = _lossless(url)
        assert full.exit_code == EXIT_CANNOT_TEST and doc["verdict"] == CANNOT_TEST, full.output
        assert doc["summary"]["missing"] == [f"greedy: {NO_SPEC_EVIDENCE}"]
        quick, doc = _lossless(url, "--quick")
        assert quick.exit_code == EXIT_CANNOT_TEST and doc["verdict"] == CANNOT_TEST
        told, doc = _lossless(url, "--quick", "--assume-speculating")
        assert told.exit_code == EXIT_OK and doc["verdict"] == PASS_ASSERTED, told.output
        assert doc["gates"][0]["stats"]["assumed"] and doc["gates"][0]["stats"]["source"] == "none"
        plain = runner.invoke(cli.app, ["lossless", "--baseline", f"openai:{url}", "--candidate", f"openai:{url}",
                                        "--num-prompts", "2", "--max-tokens", "6", "--no-record", "--quick",
                                        "--assume-speculating"])
        assert "VERDICT: PASS (speculation asserted by the user, not observed)" in plain.output
        s, sdoc = _sampled(url)
        assert s.exit_code == EXIT_CANNOT_TEST and sdoc["verdict"] == CANNOT_TEST, s.output
        assert sdoc["missing"] == [NO_SPEC_EVIDENCE] and sdoc["speculation"][""]["source"] == "none"
        s, sdoc = _sampled(url, "--assume-speculating")
        assert s.exit_code == EXIT_OK and sdoc["verdict"] == PASS_ASSERTED, s.output
    with serving(FakeServer("vllm", metrics=True)) as url:  # counters present, zero drafts
        for extra in ((), ("--assume-speculating",)):
            r, doc = _lossless(url, "--quick", *extra)
            assert r.exit_code == EXIT_FAIL and doc["verdict"] == NOT_SPECULATING, r.output
            s, sdoc = _sampled(url, *extra)
            assert s.exit_code == EXIT_FAIL and sdoc["verdict"] == NOT_SPECULATING, s.output
    with serving(FakeServer("vllm", spec=True, metrics=False, steps=True)) as url:  # speculating, seen in the stream
        r, doc = _lossless(url, "--quick")
        assert r.exit_code == EXIT_OK and doc["verdict"] == PASS, r.output
        assert doc["gates"][0]["stats"]["source"] == "stream chunks"
        s, sdoc = _sampled(url)
        assert s.exit_code == EXIT_OK and sdoc["verdict"] == PASS, s.output
        assert sdoc["speculation"][""]["source"] == "stream chunks"


# ---- 3. several sampled candidates: each its own BH family ---------------------------------------------------


def _comparison(label: str, pvals: list[float]):
    from specbench.suites.sampled import stats
    from specbench.suites.sampled.gate import Cell, Comparison

    a, b = np.array([0, 1, 0, 1]), np.array([1, 0, 1, 0])
    cells = [Cell("p", "t1", i, 4, 4, 2, 1.0, p, 99, 0.1, math.inf, math.inf) for i, p in enumerate(pvals)]
    r = stats.PermResult(1.0, 50, 99, 2)
    return Comparison("spec", ("baseline", f"candidate[{label}]"), cells, 0.0, label,
                      [(a, b, r, stats.Permuter(4, 4, 19, seed=0)) for _ in pvals])


def test_one_candidates_failure_never_marks_another():
    """The issue's run: a hard failure of the n-gram candidate (many tiny p-values) and a clean DFlash candidate with
    two cells at p 0.0015 among 96. One pooled family rejected the clean candidate's two cells (its BH threshold
    loosened by the other's 50 rejections); per candidate they stand."""
    from specbench.suites.sampled.config import SampledGateOptions
    from specbench.suites.sampled.gate import adjust, adjust_per_candidate

    opts = SampledGateOptions(refine=False)
    bad_p = [1e-5] * 50 + [0.5] * 46
    good_p = [0.0015, 0.0015] + [0.2 + 0.008 * i for i in range(94)]
    pooled = [_comparison("ngram", bad_p), _comparison("dflash", good_p)]
    adjust(pooled, opts)  # the old rule: one family over both
    assert len(pooled[1].rejected) == 2  # the clean candidate marked by its neighbour
    own = [_comparison("ngram", bad_p), _comparison("dflash", good_p)]
    adjust_per_candidate(own, opts)
    assert len(own[0].rejected) == 50 and not own[1].rejected
    # each candidate's q-values are BH over its own cells, judged at q / 2
    from specbench.suites.sampled import stats
    assert [c.q_value for c in own[1].cells] == pytest.approx(list(stats.bh_adjusted(good_p)))
    alone = [_comparison("dflash", good_p)]
    adjust_per_candidate(alone, opts)  # one candidate: q itself (nothing changes for a single-candidate run)
    assert not alone[0].rejected and alone[0].cells[0].q_value == own[1].cells[0].q_value


def test_a_faulty_and_a_clean_candidate_on_the_tiny_pair(tiny_pair):
    """The default candidates, one with a sampling fault armed (engine/faults.py): the faulty one FAILs, the clean
    one PASSes on its own evidence, the run FAILs (exit 1)."""
    from test_sampled import CI_CONFIGS, CI_OPTS, _candidate

    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.sampled.config import SOFT_Q_MIX, SampledGateOptions, parse_configs
    from specbench.suites.sampled.gate import run_gate

    t, _ = tiny_pair
    base = LocalAdapter.from_dirs(t, spec="off", name="baseline")
    cands = [_candidate(tiny_pair, "ngram", "biased_accept", float(SOFT_Q_MIX), name="ngram-soft"),
             _candidate(tiny_pair, "dflash", name="dflash")]
    try:
        res = run_gate(base, cands, SampledGateOptions(**CI_OPTS, seed_repeat=0), parse_configs(CI_CONFIGS))
    finally:
        for a in (base, *cands):
            a.close()
    assert res.candidate_verdicts == {"ngram-soft": "FAIL", "dflash": "PASS"}, res.summary()["comparisons"]
    assert res.verdict == "FAIL" and res.exit_code == EXIT_FAIL
    assert res.summary()["family"]["q_per_candidate"] == pytest.approx(0.025)


# ---- 4. the rule applied is the rule stated ---------------------------------------------------------------------


class Fp32(FakeAdapter):
    def describe(self) -> dict:
        d = super().describe()
        d["config"] = {**d["config"], "dtype": "float32"}
        return d


def test_a_typed_margin_is_honoured_and_the_default_in_fp32_is_strict():
    both = (Fp32(), Fp32())
    typed = resolve_rule(GreedyGateOptions(margin_tol=0.2, margin_given=True), *both)
    assert typed.rule == "margin" and typed.tol == 0.2 and "as typed" in typed.rule_reason
    assert "float32" in typed.rule_reason and "--strict" in typed.rule_reason
    default = resolve_rule(GreedyGateOptions(), *both)
    assert default.rule == "strict" and "no --margin-tol typed" in default.rule_reason
    with pytest.raises(LosslessError, match="--margin-tol 0.3 and --strict"):
        LosslessConfig(margin_tol=0.3, strict=True)
    assert LosslessConfig(margin_tol=0.3, strict=False).gate_options.margin_given


def _flip_run(tmp_path, margin_tol):
    """A 0.01-nat flip at position 5 on an fp32 pair: a tie at a 0.2-nat margin, no tie at fp32 exactness."""
    from test_lossless_teeth import alt_at

    gaps = {5: 0.01}
    cfg = LosslessConfig(num_prompts=1, max_tokens=8, margin_tol=margin_tol, accept_reference=False)

    class OnePrompt(Fp32):
        async def tokenize(self, text: str) -> list[int]:
            return [5, 6, 7]  # the prompt whose greedy context reaches length 5 at output position 2

    async def go(run):
        return await run_lossless(OnePrompt(gaps), OnePrompt(gaps, picks={5: alt_at(5)}), cfg, run=run)

    with open_run("lossless", "1", results=tmp_path) as run:
        out = asyncio.run(go(run))
    return out, run.path


def test_the_tolerance_that_judged_is_in_the_verdict_line_the_reports_and_the_records(tmp_path):
    typed, path = _flip_run(tmp_path / "typed", 0.2)
    assert typed.verdict == PASS and typed.summary()["flips"] == 1  # the user's margin judged the flip benign
    line = render_console(typed).splitlines()[-1]
    assert line.startswith("VERDICT: PASS") and "tolerance margin 0.2 nat for every gate (--margin-tol 0.2 as typed" \
        in line
    md = render_markdown(typed)
    assert "Tolerance: margin 0.2 nat for every gate" in md and "| greedy | PASS | margin 0.2 nat |" in md
    gate = json.loads((path / "gates.jsonl").read_text().splitlines()[0])
    check = json.loads((path / "checks.jsonl").read_text().splitlines()[0])
    assert gate["rule"]["mode"] == check["tolerance"]["mode"] == "margin" and check["tolerance"]["margin_given"]
    strict, path = _flip_run(tmp_path / "strict", None)
    assert strict.verdict == "FAIL" and strict.rule["mode"] == "strict"  # no margin typed: fp32 exactness
    assert "tolerance strict 0.0004 nat for every gate (both engines run float32 (no --margin-tol typed))" in \
        render_console(strict).splitlines()[-1]
    assert json.loads((path / "checks.jsonl").read_text().splitlines()[0])["tolerance"]["mode"] == "strict"
    # specbench report renders the rule of the run and of each gate from the records
    from specbench.harness.results import load_stored_run
    from specbench.suites.report.kinds import _lossless as render_lossless_kind

    text = "\n".join(render_lossless_kind(load_stored_run(path)))
    assert "tolerance strict 0.0004 nat (both engines run float32" in text and "| strict 0.0004 nat |" in text


# ---- 5. each CANNOT TEST gives the reason that is true -------------------------------------------------------


def test_headroom_without_local_geometry_gives_that_reason_alone():
    g = asyncio.run(headroom(FakeAdapter(), FakeAdapter(), PROMPTS, 8, GreedyGateOptions()))
    assert g.verdict == CANNOT_TEST and g.missing == [EMPTY_REASONS["headroom"]]
    assert g.stats.describe() == "not measured: the gate sent no candidate request"
    md = render_markdown_of(g)
    assert "reports no spec counters" not in md and "no prompt was tested" not in md
    assert g.rule["mode"] == "margin"  # and the tolerance it would have judged by is recorded


def render_markdown_of(g) -> str:
    from specbench.suites.lossless.suite import LosslessOutcome

    return render_markdown(LosslessOutcome([g], {}, {"top_k": 20, "max_divergences": 8}, rule=g.rule))


def test_gates_that_sent_no_request_say_why_once():
    class NoText(FakeAdapter):  # ids but no text: no stop string can be picked
        pass

    g = asyncio.run(stop_in_run(NoText(), NoText(), PROMPTS, 8, GreedyGateOptions()))
    assert g.verdict == CANNOT_TEST and g.missing == [
        "a stop string to test: no baseline output of 3 prompts had text to pick one from"]
    empty = NoLogprobs(empty=True)
    g = asyncio.run(min_tokens(empty, empty, PROMPTS, 8, GreedyGateOptions()))
    assert g.verdict == CANNOT_TEST and g.missing == [EMPTY_REASONS["min-tokens"]]
    assert isinstance(g.stats, AcceptanceEvidence) and g.stats.source == "not measured"
