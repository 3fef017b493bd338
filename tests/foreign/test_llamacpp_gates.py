"""Every gate against llama.cpp's llama-server (issue #27): the verdicts, not just the plumbing.

Through the real commands (`specbench lossless / sampled / sweep`), with the session's servers from
tests/foreign/conftest.py:
- the greedy regret gate and the concurrent gate pass for draft-model, n-gram and DFlash speculation
  against speculation off, and speculation is observed through the `llamacpp:` counters;
- a deliberately broken pairing (the perturbed model as "spec off") fails the regret gate;
- a capability removed (no output ids: the adapter told not to probe, so it takes /v1/completions,
  which ignores return_token_ids; no /tokenize: a pass-through proxy that 404s it) gives CANNOT TEST and
  exit 3, never PASS; the same for the sampled gate with nothing readable;
- the sampled gate at T > 0 passes for the draft-model pairing;
- a short sweep c1,4 with --audit writes its report; the audit cross-checks the per-request
  `timings.draft_n` / `draft_n_accepted` against the `llamacpp:spec_decode_*` counter deltas.
Dialect findings are kept as regression checks: the capability record the probe writes, and that under
speculation the tokens of a verify step come back without logprobs (flagged as missing by the adapter).
Sizes are small (4 prompts x 32 tokens; 1 prompt x 4 positions x 128 samples): the file runs in well under
a minute once the servers are up.

Every command is a recorded scenario (`cli(name, *args, expect=...)`): its results run goes to
<llamacpp_results>/<name>/ and a `scenario` record (argv with server labels, exit code, the expected one)
to foreign.jsonl, the records reports/foreign/llamacpp.md is rendered from (scripts/foreign-report.sh).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from dialect_fakes import proxy_app, serving
from typer.testing import CliRunner

from specbench.harness.adapters.base import GenRequest
from specbench.harness.adapters.dialect import missing_positions
from specbench.harness.adapters.openai_api import OpenAIAdapter
from specbench.harness.verdicts import CANNOT_TEST, EXIT_CANNOT_TEST, EXIT_FAIL, EXIT_OK

LOSSLESS = ("--num-prompts", 4, "--max-tokens", 32, "--concurrent", "--json")
REPO = Path(__file__).resolve().parents[2]
URL = re.compile(r"http://127\.0\.0\.1:\d+")


@pytest.fixture(scope="module")
def cli(llamacpp_results, llamacpp_record, llamacpp_label):
    from specbench.cli.app import _register, app

    _register()
    runner = CliRunner()

    def shown(arg: str) -> str:  # the argv as the report shows it: server labels, no machine paths
        arg = URL.sub(lambda m: f"<{llamacpp_label(m.group(0))}>", arg)
        return arg.replace(str(llamacpp_results), "$RESULTS").replace(f"{REPO}/", "")

    def run(scenario: str, *args, expect: int, about: str = ""):
        """Run one specbench command; its results run goes to <results>/<scenario>/, a record to foreign.jsonl."""
        argv = [str(a) for a in args]
        argv += ["--out" if argv[0] == "sweep" else "--results", str(llamacpp_results / scenario)]
        r = runner.invoke(app, argv)
        lines = r.stdout.strip().splitlines()
        try:
            doc = json.loads(lines[-1]) if lines else None
        except ValueError:
            doc = None
        llamacpp_record("scenario", name=scenario, about=about, argv=["specbench", *map(shown, argv)],
                        exit_code=r.exit_code, expect_exit=expect, results=scenario,
                        verdict=doc.get("verdict") if isinstance(doc, dict) else None,
                        exception=repr(r.exception) if r.exception and not isinstance(r.exception, SystemExit)
                        else None)
        return r, doc

    return run


def _oa(server, **opts) -> str:
    return f"openai:{server.base_url}" + "".join(f",{k}={v}" for k, v in opts.items())


@pytest.mark.parametrize("kind", ["draft", "ngram", "dflash"])
def test_lossless_pairs_pass(kind, request, cli, llamacpp_off, llamacpp_notes):
    cand = request.getfixturevalue(f"llamacpp_{kind}")
    r, doc = cli(f"lossless-{kind}", "lossless", "--baseline", _oa(llamacpp_off), "--candidate", _oa(cand), *LOSSLESS,
                 expect=EXIT_OK, about=f"the default gate set (greedy, concurrent, the engine gates): {kind} "
                 "speculation vs spec off")
    assert r.exit_code == EXIT_OK, r.output[-3000:]
    gates = doc["summary"]["gates"]
    assert doc["verdict"] == "PASS" and gates["greedy"] == gates["concurrent"] == "PASS", \
        (doc["gates"][0]["stats"], doc["engines"]["candidate"].get("capabilities"))
    # every engine gate ran on llama-server too: none failed, and what one could not test is named beside the verdict
    assert set(gates) >= {"mixed", "stop-in-run", "eos-in-run", "abort-in-flight", "penalties", "logit-bias",
                          "min-tokens", "headroom"}
    assert all(v == "PASS" or v == "CANNOT TEST" and any(m.startswith(f"{n}: ") for m in doc["summary"]["not_tested"])
               for n, v in gates.items()), (gates, doc["summary"]["not_tested"])
    g = doc["gates"][0]
    assert g["stats"]["source"] == "counters" and g["stats"]["speculating"] is True  # llamacpp: counters
    assert doc["engines"]["candidate"]["capabilities"]["dialect"] == "llamacpp"
    untested = sorted({m.split(":")[0] for m in doc["summary"]["not_tested"]})
    llamacpp_notes.append(f"lossless {kind}: PASS, mean accepted length {g['stats']['mean_accept_len']:.2f} "
                          f"({g['stats']['num_drafts']} verify steps); {len(gates)} gates, not tested here: "
                          f"{', '.join(untested) or 'none'}")


def test_broken_pairing_fails_the_regret_gate(cli, llamacpp_wrong, llamacpp_draft):
    r, doc = cli("broken-pairing", "lossless", "--baseline", _oa(llamacpp_wrong), "--candidate", _oa(llamacpp_draft),
                 *LOSSLESS, expect=EXIT_FAIL,
                 about="two different GGUF models: the perturbed one as \"spec off\", the target + drafter as spec on")
    assert r.exit_code == EXIT_FAIL, r.output[-3000:]
    assert doc["verdict"] == "FAIL"
    kinds = {d["judgement"]["kind"] for g in doc["gates"] for p in g["prompts"] for d in p["divergences"]
             if d.get("judgement") and not d["judgement"]["ok"]}
    assert kinds and kinds <= {"regret", "outside_topk"}


def test_no_output_ids_is_cannot_test(cli, llamacpp_off, llamacpp_draft):
    # probe=0: the old generic route (/v1/completions), which ignores return_token_ids
    r, doc = cli("no-output-ids", "lossless", "--baseline", _oa(llamacpp_off), "--candidate",
                 _oa(llamacpp_draft, probe=0), *LOSSLESS, expect=EXIT_CANNOT_TEST,
                 about="capability removed: the candidate not probed (/v1/completions, which ignores return_token_ids)")
    assert r.exit_code == EXIT_CANNOT_TEST, r.output[-3000:]
    assert doc["verdict"] == CANNOT_TEST
    assert any("output token ids" in m for m in doc["summary"]["missing"])


def test_no_tokenize_is_cannot_test(cli, llamacpp_off, llamacpp_draft, llamacpp_label, tiny_target):
    with serving(proxy_app(llamacpp_off.base_url, blocked=("/tokenize",))) as b, \
            serving(proxy_app(llamacpp_draft.base_url, blocked=("/tokenize",))) as c:
        llamacpp_label(b, "off, /tokenize 404")
        llamacpp_label(c, "draft, /tokenize 404")
        r, doc = cli("no-tokenize", "lossless", "--baseline", f"openai:{b}", "--candidate", f"openai:{c}", *LOSSLESS,
                     expect=EXIT_CANNOT_TEST, about="capability removed: both servers behind a proxy that 404s /tokenize")
        assert r.exit_code == EXIT_CANNOT_TEST, r.output[-3000:]
        assert doc["verdict"] == CANNOT_TEST and doc["gates"] == [] and "tokenize" in doc["summary"]["missing"][0]
        # the model's own tokenizer, round-trip checked and compared with the endpoint's prompt token count
        r, doc = cli("no-tokenize+tokenizer", "lossless", "--baseline", f"openai:{b}", "--candidate", f"openai:{c}",
                     "--tokenizer", tiny_target, "--num-prompts", 2, "--max-tokens", 16, "--json", expect=EXIT_OK,
                     about="the same, with --tokenizer DIR: the model's tokenizer used locally restores the gate")
        assert r.exit_code == EXIT_OK, r.output[-3000:]
        assert doc["engines"]["baseline"]["capabilities"]["tokenizer"]["agrees_with_endpoint"] is True


SAMPLED = ("--num-prompts", 1, "--positions", 4, "--samples", 128, "--configs", "t=1.0;t=0.7,k=20",
           "--permutations", 199, "--concurrency", 4, "--json")


def test_sampled_gate_at_t_gt_0(cli, llamacpp_off, llamacpp_draft, llamacpp_notes):
    r, doc = cli("sampled", "sampled", "--baseline", _oa(llamacpp_off), "--candidate", _oa(llamacpp_draft), *SAMPLED,
                 expect=EXIT_OK, about="sampled gate at T > 0 (t=1.0; t=0.7, k=20): draft-model vs spec off")
    assert r.exit_code == EXIT_OK, r.output[-3000:]
    assert doc["verdict"] == "PASS" and doc["comparisons"]["spec"]["testable"] > 0
    assert doc["spec"]["num_accepted_tokens"] > 0 and doc["spec"]["source"] == "metrics"
    seeds = doc["seed_repeat"][""]  # llama-server honours per-request seeds, speculating or not
    llamacpp_notes.append(f"sampled seed repeat: baseline {seeds['baseline'][0]} / {seeds['baseline'][1]} differ, "
                          f"candidate {seeds['candidate'][0]} / {seeds['candidate'][1]}: {seeds['verdict']}")
    assert seeds["verdict"] == "PASS" and seeds["candidate"][1] > 0


def test_sampled_without_readable_samples_is_cannot_test(cli, llamacpp_off, llamacpp_draft, llamacpp_label):
    with serving(proxy_app(llamacpp_draft.base_url, blocked=("/tokenize",))) as c:
        llamacpp_label(c, "draft, /tokenize 404")
        r, doc = cli("sampled-unreadable", "sampled", "--baseline", _oa(llamacpp_off), "--candidate",
                     f"openai:{c},probe=0", "--num-prompts", 1, "--positions", 4, "--samples", 16, "--configs",
                     "t=1.0", "--permutations", 19, "--json", expect=EXIT_CANNOT_TEST,
                     about="capability removed: a candidate without ids and without /tokenize (samples unreadable)")
    assert r.exit_code == EXIT_CANNOT_TEST, r.output[-3000:]
    assert doc["verdict"] == CANNOT_TEST and doc["missing"]


def test_sweep_with_report_and_metrics_audit(cli, llamacpp_off, llamacpp_draft, llamacpp_results, llamacpp_notes):
    out = llamacpp_results / "sweep"
    report = out / "sweep.md"
    r, _ = cli("sweep", "sweep", "--arms", f"{_oa(llamacpp_off, name='spec-off')};{_oa(llamacpp_draft, name='draft')}",
               "--concurrency", "1,4", "--num-prompts", 4, "--max-tokens", 32, "--rounds", 2, "--warmup", 1,
               "--no-progress", "--report", report, "--audit", expect=EXIT_OK,
               about="sweep c1,4 spec off vs draft-model, with its report and --audit (the metrics audit as a gate)")
    assert r.exit_code == EXIT_OK, r.output[-3000:]
    assert "acceptance audit: PASS" in r.output
    md = report.read_text()
    assert "### Acceptance / metrics audit: PASS" in md and "### Endpoint capabilities" in md
    run_dir = next(p for p in out.iterdir() if p.is_dir() and p.name.startswith("sweep-"))
    audit = json.loads((run_dir / "audit.jsonl").read_text().splitlines()[-1])
    draft = next(a for a in audit["arms"] if a["arm"] == "draft")
    assert draft["verdict"] == "PASS" and draft["cross_checked"] > 0 and draft["drafts"] > 0
    assert any(s.startswith("per-request (timings)") for s in draft["sources"])
    cells = {a["arm"]: a["cell_verdicts"] for a in audit["arms"]}
    assert all(c["FAIL"] == 0 and c["CANNOT TEST"] == 0 and c["PASS"] == a["cells"]
               for a, c in zip(audit["arms"], cells.values(), strict=True)), cells  # every cell judged, none FAILs
    llamacpp_notes.append(f"sweep audit (draft): {draft['drafts']} verify steps, {draft['draft_tokens']} draft "
                          f"tokens, {draft['accepted']} accepted; per-request sums = llamacpp: counters on "
                          f"{draft['cross_checked']} cells; cells PASS per arm: "
                          + ", ".join(f"{k} {v['PASS']}" for k, v in cells.items()))


def test_dialect_record_regression(llamacpp_off, llamacpp_draft):
    """What the probe finds in this llama.cpp (commit 0c1e570); a change here is a dialect change."""
    caps = OpenAIAdapter(llamacpp_draft.base_url, probe=True).probe().to_dict()
    assert caps["dialect"] == "llamacpp" and "0c1e570" in caps["server"]["build"]
    assert caps["tokenize"] == "content" and caps["generate_route"] == "/completion"
    assert caps["output_ids"] == "tokens" and caps["logprobs"] == "native" and caps["top_logprobs"] == 20
    assert caps["prompt_logprobs"] is False and caps["scoring"] == "generation"  # echo is ignored
    assert caps["usage"] == "final" and caps["metrics_prefix"] == "llamacpp:"
    assert caps["per_request_spec"] == "timings" and caps["prompt_cache"] == "cache_prompt"
    assert caps["sampler_defaults"]["top_k"] == 40 and caps["sampler_defaults"]["min_p"] == pytest.approx(0.05)


def test_finding_verify_step_tokens_carry_no_logprobs(llamacpp_off, llamacpp_draft):
    """Under speculation every token that comes out of a verify step (accepted drafts and the target's own
    token after them) has no logprobs, streamed or not; the adapter flags those positions as missing."""
    prompt = "Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:"
    for stream in (True, False):
        off = OpenAIAdapter(llamacpp_off.base_url, probe=True, stream=stream)
        on = OpenAIAdapter(llamacpp_draft.base_url, probe=True, stream=stream)
        req = GenRequest(prompt=off.tokenize_sync(prompt), max_tokens=24, logprobs=5, prompt_cache=False)
        a, b = off.generate_sync([req])[0], on.generate_sync([req])[0]
        assert a.ok and b.ok and a.output_ids == b.output_ids
        assert missing_positions(a.logprobs) == []
        assert missing_positions(b.logprobs) and 0 not in missing_positions(b.logprobs)
        assert b.spec["num_draft_tokens"] > 0


def test_mixed_gate_logprobs_parity(llamacpp_off, llamacpp_draft, llamacpp_notes):
    """The mixed gate over llama-server: greedy and logprobs requests in one batch, the logprobs held to the spec-off
    server's over the common prefix. llama.cpp returns none for the tokens of a verify step (the finding below), so
    only the positions it did report are compared, and the missing ones are counted."""
    import asyncio

    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
    from specbench.suites.lossless.registry import GATES

    off = OpenAIAdapter(llamacpp_off.base_url, probe=True)
    on = OpenAIAdapter(llamacpp_draft.base_url, probe=True)
    texts = ["Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:",
             "Question: A train travels 60 miles in 2 hours. What is its speed?\nAnswer:"] * 2
    prompts = [Prompt(f"p{i}", off.tokenize_sync(t)) for i, t in enumerate(texts)]
    run = asyncio.run(GATES["mixed"](off, on, prompts, 24, GreedyGateOptions()))
    checks = {c.name: c for c in run.checks}
    parity = checks["logprobs-parity"]
    llamacpp_notes.append(f"mixed gate: {run.verdict}; logprobs parity: {parity.detail}; "
                          f"{checks['logprobs-speculate'].detail}")
    assert run.verdict == "PASS", [c.to_dict() for c in run.checks]
    assert parity.ok and not parity.skipped and "without a candidate logprob" in parity.detail


def test_abort_in_flight_gate(llamacpp_off, llamacpp_draft, llamacpp_notes):
    """Clients that go away mid-generation on llama-server: the connection closes under three long requests while
    two survivors decode; the survivors and a request sent afterwards stay lossless."""
    import asyncio

    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
    from specbench.suites.lossless.registry import GATES

    off = OpenAIAdapter(llamacpp_off.base_url, probe=True)
    on = OpenAIAdapter(llamacpp_draft.base_url, probe=True)
    texts = ["Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:",
             "Question: A train travels 60 miles in 2 hours. What is its speed?\nAnswer:",
             "Question: Sara reads 12 pages a day. How many pages does she read in a week?\nAnswer:"]
    prompts = [Prompt(f"p{i}", off.tokenize_sync(t)) for i, t in enumerate(texts)]
    run = asyncio.run(GATES["abort-in-flight"](off, on, prompts, 32, GreedyGateOptions()))
    checks = {c.name: c for c in run.checks}
    llamacpp_notes.append(f"abort-in-flight gate: {run.verdict}; {checks['aborted-in-flight'].detail}")
    assert run.verdict == "PASS", ([c.to_dict() for c in run.checks], run.notes, [p.reason for p in run.prompts])


def test_penalties_gate(llamacpp_off, llamacpp_draft, llamacpp_notes):
    """Penalties over llama-server (the adapter sends repetition_penalty as llama.cpp's repeat_penalty): they are
    honoured (the output moves), and the penalties gate passes draft-model speculation against spec off."""
    import asyncio

    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
    from specbench.suites.lossless.registry import GATES

    off = OpenAIAdapter(llamacpp_off.base_url, probe=True)
    on = OpenAIAdapter(llamacpp_draft.base_url, probe=True)
    ids = off.tokenize_sync("Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:")
    plain, rep = off.generate_sync([GenRequest(prompt=ids, max_tokens=40, ignore_eos=True, prompt_cache=False),
                                    GenRequest(prompt=ids, max_tokens=40, ignore_eos=True, prompt_cache=False,
                                               repetition_penalty=1.3)])
    assert plain.ok and rep.ok and plain.output_ids != rep.output_ids  # repeat_penalty reached the sampler
    prompts = [Prompt("p0", ids), Prompt("p1", off.tokenize_sync("Question: A train travels 60 miles in 2 hours. "
                                                                 "What is its speed?\nAnswer:"))]
    run = asyncio.run(GATES["penalties"](off, on, prompts, 32, GreedyGateOptions()))
    llamacpp_notes.append(f"penalties gate: {run.verdict}; {run.stats.describe()}")
    assert run.verdict == "PASS", [(p.pid, p.status, p.reason) for p in run.prompts]


def test_logit_bias_and_min_tokens_gates(llamacpp_off, llamacpp_draft, llamacpp_notes):
    """llama-server honours OpenAI's logit_bias (a -100 bias bans a token its greedy output had), so the logit-bias
    gate judges draft-model speculation against spec off; it has no min_tokens (nor stop_token_ids on this route),
    so the min-tokens gate finds a baseline that ignores it and says CANNOT TEST rather than PASS."""
    import asyncio

    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
    from specbench.suites.lossless.registry import GATES

    off = OpenAIAdapter(llamacpp_off.base_url, probe=True)
    on = OpenAIAdapter(llamacpp_draft.base_url, probe=True)
    ids = off.tokenize_sync("Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:")
    plain = off.generate_sync([GenRequest(prompt=ids, max_tokens=24, ignore_eos=True, prompt_cache=False)])[0]
    ban = {plain.output_ids[2]: -100.0}
    biased = off.generate_sync([GenRequest(prompt=ids, max_tokens=24, ignore_eos=True, prompt_cache=False,
                                           logit_bias=ban)])[0]
    assert biased.ok and plain.output_ids[2] not in biased.output_ids  # the bias reached the sampler
    prompts = [Prompt("p0", ids), Prompt("p1", off.tokenize_sync("Question: A train travels 60 miles in 2 hours. "
                                                                 "What is its speed?\nAnswer:"))]
    run = asyncio.run(GATES["logit-bias"](off, on, prompts, 32, GreedyGateOptions()))
    llamacpp_notes.append(f"logit-bias gate: {run.verdict}; {run.stats.describe()}")
    assert run.verdict == "PASS", (run.cannot_test, [(p.pid, p.status, p.reason) for p in run.prompts])
    run = asyncio.run(GATES["min-tokens"](off, on, prompts, 32, GreedyGateOptions()))
    llamacpp_notes.append(f"min-tokens gate: {run.verdict}; {run.cannot_test}")
    assert run.verdict == "CANNOT TEST" and run.cannot_test, (run.verdict, [(p.pid, p.status) for p in run.prompts])


def test_accept_trace_gate_against_llamacpp_dflash(llamacpp_off, llamacpp_dflash, llamacpp_notes, tiny_pair,
                                                    tmp_path):
    """llama.cpp's DFlash against the drafter replayed on its own outputs (issue 47 item 1): llama-server reports
    per request only its draft and accepted token totals (timings), and with the f32 target and drafter they must
    equal the replay's (Hugging Face's target, our drafter's dense path) exactly: two engines step for step. The
    replay told the wrong checkpoint (the bundled drafter as it is, tapping [1, 3]; llama.cpp runs it re-tapped to
    [1, 2]) disagrees: FAIL. The same gate through the CLI: --replay-drafter."""
    import asyncio

    from specbench.harness.foreign.gguf import DFLASH_SAFE_TAPS, retapped_drafter
    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
    from specbench.suites.lossless.registry import GATES

    target, draft = tiny_pair
    retapped = retapped_drafter(Path(draft), tmp_path / "dflash", DFLASH_SAFE_TAPS)
    off = OpenAIAdapter(llamacpp_off.base_url, probe=True)
    texts = ["Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:",
             "Question: A train travels 60 miles in 2 hours. What is its speed?\nAnswer:",
             "Question: Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes. How much did she earn?"
             "\nAnswer:", "Question: What is 17 times 3?\nAnswer:"]
    prompts = [Prompt(f"p{i}", off.tokenize_sync(t)) for i, t in enumerate(texts)]

    def gate(drafter) -> object:
        on = OpenAIAdapter(llamacpp_dflash.base_url, probe=True)
        opts = GreedyGateOptions(replay=f"target={target},draft={drafter},exact=true")
        return asyncio.run(GATES["accept-trace"](off, on, prompts, 48, opts))

    run = gate(retapped)
    ev = run.evidence
    llamacpp_notes.append(f"accept-trace vs llama.cpp DFlash: {run.verdict}; {run.notes[0]}")
    assert run.verdict == "PASS", (run.notes, [c.to_dict() for c in run.checks])
    assert ev["totals"] and ev["requests"] == ev["equal"] == 4 and ev["replay_accepted"] > 0, ev
    wrong = gate(draft)
    assert wrong.verdict == "FAIL" and "exact totals" in wrong.failed_checks[0].name, wrong.notes
