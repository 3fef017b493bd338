"""What specbench's gates found in llama.cpp (commit 0c1e570), kept as regression checks (issue #27).

Each test reproduces one finding on the session's servers, writes a `finding` record (what was measured in
this run, the cause where the vendored source shows it, a minimal reproduction: the server kind of
`python -m specbench.harness.foreign.llamacpp serve KIND` plus the request bodies) and warns when the
behaviour changed. None of them fails on the finding itself: they fail only when the servers do not
answer as a server should. reports/foreign/llamacpp.md lists them (scripts/foreign-report.sh).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import warnings

import pytest

from specbench.harness.adapters.dialect import PROBE_TEXT
from specbench.harness.foreign import llamacpp as lc

SPEC = "llamacpp:spec_decode_"
GREEDY = {"temperature": 0, "top_k": 1, "return_tokens": True, "ignore_eos": True, "seed": 0}


@pytest.fixture(scope="module")
def finding(llamacpp_record, llamacpp_notes):
    def record(id: str, title: str, present: bool, observed: str, repro: dict, *, expected: str,
               cause: str | None = None, impact: str | None = None, evidence: dict | None = None) -> dict:
        status = "present" if present else "changed"
        llamacpp_notes.append(f"FINDING {id}: {status}: {observed}")
        if not present:
            warnings.warn(f"llama.cpp finding {id!r} no longer reproduces: {observed}", stacklevel=2)
        return llamacpp_record("finding", id=id, title=title, status=status, observed=observed, expected=expected,
                               cause=cause, impact=impact, evidence=evidence or {}, repro=repro)

    return record


def source_line(build: lc.Build, rel: str, needle: str) -> str | None:
    """`rel:line` of the first line of the vendored source containing `needle`, or None."""
    try:
        lines = (build.src / rel).read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((f"{rel}:{i}" for i, ln in enumerate(lines, 1) if needle in ln), None)


def completion(server: lc.LlamaServer, body: dict) -> dict:
    status, out = server.post("/completion", body)
    assert status == 200 and isinstance(out, dict), f"{server.name}: HTTP {status} {str(out)[:300]}"
    return out


def counters(server: lc.LlamaServer) -> dict[str, float]:
    return {k[len(SPEC):]: v for k, v in server.metrics().items() if k.startswith(SPEC)}


def test_finding_dflash_last_layer_tap(llamacpp_build, llamacpp_models, tmp_path, finding):
    """A DFlash drafter whose target_layer_ids include the target's last layer: llama.cpp loads it, then aborts
    on the first request (`GGML_ASSERT(t_layer_inp[il] != nullptr)`) instead of refusing it at load.
    Records which happens: 'refused at load', 'aborts on first request', 'refused the request', 'served'."""
    body = {"prompt": PROBE_TEXT, "n_predict": 16, "temperature": 0, "top_k": 1, "cache_prompt": False}
    outcome, detail, exit_code, assert_line = "served", "", None, None
    try:
        s = lc.start_server("dflash-lasttap", llamacpp_models, llamacpp_build, threads=1, log_dir=tmp_path,
                            health_timeout_s=60)
    except lc.Unavailable as e:
        outcome, detail = "refused at load", str(e).splitlines()[0]
    else:
        try:
            try:
                status, out = s.post("/completion", body, timeout=60)
            except OSError as e:  # connection reset: the process died mid-request
                status, out = None, str(e)
                with contextlib.suppress(subprocess.TimeoutExpired):  # dying: wait for its exit (a hang guard)
                    s.proc.wait(60)
            if not s.alive():
                asserts = [ln.strip() for ln in s.log_path.read_text(errors="replace").splitlines() if "GGML_ASSERT" in ln]
                exit_code = s.proc.poll() if s.proc else None
                # the path up to the vendored tree is where the build ran: not part of the finding
                assert_line = re.sub(r"^.*?/vendor/llama\.cpp/", "", asserts[0]) if asserts else None
                outcome = "aborts on first request"
                detail = f"exit {exit_code}; {assert_line or 'no GGML_ASSERT line in the log'}"
            elif status != 200:
                outcome, detail = "refused the request", f"HTTP {status} {str(out)[:200]}"
        finally:
            s.stop()
    taps = llamacpp_models.info.get("dflash_taps", {})
    n_layers = json.loads((lc.BUNDLED / "target" / "config.json").read_text()).get("num_hidden_layers")
    finding(
        "dflash-last-layer-tap",
        "A DFlash drafter tapping the target's last layer aborts llama-server at the first request",
        outcome == "aborts on first request", f"{outcome} ({detail})",
        {"serve": "dflash-lasttap", "requests": [{"route": "/completion", "body": body}]},
        expected="the checkpoint refused at load with a message (llama.cpp cannot extract the last layer's input)",
        cause=(f"the drafter's target_layer_ids {taps.get('dflash_lasttap')} include layer {n_layers - 1} of "
               f"{n_layers} (the last); `{assert_line}`" if n_layers and assert_line else None),
        impact=(f"a drafter re-tapped to {taps.get('dflash')} serves (the `dflash` server); Z Lab's published "
                "DFlash checkpoints never tap the last layer"),
        evidence={"outcome": outcome, "exit_code": exit_code, "assert": assert_line, "taps": taps,
                  "target_layers": n_layers})


def test_finding_verify_step_tokens_lack_logprobs(llamacpp_off, llamacpp_draft, llamacpp_build, finding):
    """Under speculation every token a verify step emits (the accepted drafts and the target's own token after
    them) comes back with logprob 0.0 and an empty top_logprobs; only tokens sampled outside a verify step
    (position 0 at least) have them. Spec off has them all."""
    body = {"prompt": PROBE_TEXT, "n_predict": 24, "cache_prompt": False, "n_probs": 2, **GREEDY}
    off = completion(llamacpp_off, body)
    before = counters(llamacpp_draft)
    on = completion(llamacpp_draft, body)
    after = counters(llamacpp_draft)
    assert on["tokens"] == off["tokens"]
    assert all(len(c["top_logprobs"]) == 2 for c in off["completion_probabilities"])
    probs = on["completion_probabilities"]
    missing = [i for i, c in enumerate(probs) if not c["top_logprobs"]]
    zero = sum(1 for i in missing if probs[i].get("logprob") == 0.0)
    steps = int(after["num_drafts_total"] - before["num_drafts_total"])
    accepted = int(on["timings"].get("draft_n_accepted") or 0)
    emitted_by_verify = min(len(probs), accepted + steps)  # each verify step emits its accepted drafts + 1
    n = len(on["tokens"])
    finding(
        "verify-step-logprobs",
        "Under speculation no token a verify step emits has logprobs (accepted drafts and the token after them)",
        bool(missing) and 0 not in missing,
        f"{len(missing)}/{n} tokens without logprobs ({zero} with logprob 0.0 and an empty top list) on the "
        f"draft-model server; {steps} verify steps emitted {accepted} accepted drafts + {steps} target tokens = "
        f"{accepted + steps}; spec off: 0/{len(off['tokens'])} missing",
        {"serve": "draft", "requests": [{"route": "/completion", "body": body}]},
        expected="every token's logprob and top-k, as with speculation off",
        cause=(f"`TODO: set result.probs` in the speculative accept loop "
               f"({source_line(llamacpp_build, 'tools/server/server-context.cpp', 'TODO: set result.probs')}): "
               "the tokens of a verify step are sent with prob 1.0 and no probs"),
        impact=("specbench flags those positions as missing (never a distribution); the regret gate takes "
                "the baseline's logprobs (spec off), so it is unaffected"),
        evidence={"tokens": n, "missing": len(missing), "missing_positions": missing, "verify_steps": steps,
                  "accepted": accepted, "emitted_by_verify_steps": emitted_by_verify,
                  "all_verify_tokens_missing": len(missing) == emitted_by_verify})


def _first_flip(server: lc.LlamaServer, prompt: str, n: int) -> dict | None:
    """Greedy ids with the prompt cache off, then the same request twice with it on (the second reuses the
    cached prompt, re-evaluating only its last token); the first position where they differ, with the
    cache-off top-2 margin there (asked for only then: n_probs makes every request ~4x slower)."""
    base = {"prompt": prompt, "n_predict": n, "id_slot": 0, **GREEDY}
    off = completion(server, {**base, "cache_prompt": False})
    completion(server, {**base, "cache_prompt": True})
    on = completion(server, {**base, "cache_prompt": True})
    j = next((i for i, (a, b) in enumerate(zip(off["tokens"], on["tokens"], strict=True)) if a != b), None)
    if j is None:
        return None
    probs = completion(server, {**base, "n_predict": j + 1, "n_probs": 2, "cache_prompt": False})
    top = probs["completion_probabilities"][j]["top_logprobs"]
    return {"position": j, "off_pick": off["tokens"][j], "cached_pick": on["tokens"][j],
            "margin_nat": round(top[0]["logprob"] - top[1]["logprob"], 4) if len(top) > 1 else None,
            "cached_second": len(top) > 1 and top[1]["id"] == on["tokens"][j],
            "cache_n": on["timings"].get("cache_n"), "prompt_n": on["timings"].get("prompt_n")}


def test_finding_prompt_cache_flips_near_ties(llamacpp_server, llamacpp_off, gsm8k_prompts, finding):
    """The prompt cache is on by default; a request that reuses a cached prompt re-evaluates its last token
    alone, and on the quantized targets (Q8_0, Q4_0) that flips greedy near-ties (speculation off). The f32
    target does not flip. specbench's gates send cache_prompt: false."""
    n = 32
    flips: dict[str, list[dict]] = {}
    for kind in ("q8_0", "q4_0"):
        s = llamacpp_server(kind)
        flips[kind] = [dict(f, prompt=i) for i, p in enumerate(gsm8k_prompts) if (f := _first_flip(s, p, n))]
    flips["f32"] = [dict(f, prompt=i) for i, p in enumerate(gsm8k_prompts) if (f := _first_flip(llamacpp_off, p, n))]
    quant = [(k, f) for k in ("q8_0", "q4_0") for f in flips[k]]
    first = quant[0] if quant else None
    repro = {"serve": first[0] if first else "q8_0", "requests": []}
    if first:
        body = {"prompt": gsm8k_prompts[first[1]["prompt"]], "n_predict": n, "id_slot": 0, **GREEDY}
        repro["requests"] = [{"route": "/completion", "body": {**body, "cache_prompt": False}, "note": "reference"},
                             {"route": "/completion", "body": body, "note": "fills the cache (cache_prompt defaults on)"},
                             {"route": "/completion", "body": body,
                              "note": f"reuses it: tokens differ from the reference at position {first[1]['position']}"}]
    margins = sorted(f["margin_nat"] for _, f in quant if f["margin_nat"] is not None)
    finding(
        "prompt-cache-near-ties",
        "The prompt cache (on by default) flips greedy near-ties on quantized targets, speculation off",
        bool(quant) and not flips["f32"],
        "; ".join(f"{k}: {len(flips[k])}/{len(gsm8k_prompts)} prompts flip" for k in ("q8_0", "q4_0", "f32")) +
        f" ({n} greedy tokens each); cache-off top-2 margins at the flips: "
        f"{', '.join(f'{m:.4f}' for m in margins) or 'none'} nat",
        repro,
        expected="the same greedy ids with the prompt cache on and off",
        cause="with a cached prompt only its last token is evaluated, alone, instead of in the prompt batch: the "
              "quantized matmuls round differently, enough to swap two logits within a few thousandths of a nat",
        impact="benign by the regret rule (margins far below --margin-tol 0.20), but it makes spec-on vs spec-off "
               "comparisons noisy: every specbench gate request sends cache_prompt: false",
        evidence={"prompts": len(gsm8k_prompts), "tokens": n, "flips": flips})


def test_finding_max_tokens_0_decodes_one(llamacpp_off, finding):
    """`max_tokens: 0` (and the native `n_predict: 0`) still decodes one token."""
    status, v1 = llamacpp_off.post("/v1/completions", {"prompt": PROBE_TEXT, "max_tokens": 0, "temperature": 0})
    assert status == 200 and isinstance(v1, dict), (status, v1)
    native = completion(llamacpp_off, {"prompt": PROBE_TEXT, "n_predict": 0, "temperature": 0, "return_tokens": True})
    got = (v1["usage"]["completion_tokens"], len(native.get("tokens") or []))
    finding(
        "max-tokens-0",
        "`max_tokens: 0` still decodes one token",
        got != (0, 0),
        f"/v1/completions max_tokens 0: completion_tokens {got[0]} (text {v1['choices'][0]['text']!r}); "
        f"/completion n_predict 0: {got[1]} token(s)",
        {"serve": "off", "requests": [{"route": "/v1/completions",
                                       "body": {"prompt": PROBE_TEXT, "max_tokens": 0, "temperature": 0}}]},
        expected="no output token (vLLM: max_tokens 0 with echo scores the prompt)",
        impact="no prompt scoring through max_tokens 0: specbench scores a continuation with one 1-token "
               "generation per position (capabilities.scoring = generation)",
        evidence={"v1_completion_tokens": got[0], "native_tokens": got[1]})


def test_finding_v1_completions_ignores_echo_and_ids(llamacpp_off, finding):
    """/v1/completions accepts `echo` and `return_token_ids` and ignores both: no prompt in the text, no prompt
    logprobs, no token ids (the native /completion has ids with return_tokens: true)."""
    body = {"prompt": PROBE_TEXT, "max_tokens": 4, "temperature": 0, "echo": True, "return_token_ids": True,
            "logprobs": 1}
    status, out = llamacpp_off.post("/v1/completions", body)
    assert status == 200 and isinstance(out, dict), (status, out)
    ch = out["choices"][0]
    content = (ch.get("logprobs") or {}).get("content") or []
    echoed = ch["text"].startswith(PROBE_TEXT)
    ids = [k for k in ("token_ids", "prompt_token_ids", "tokens") if k in ch or k in out]
    finding(
        "v1-completions-echo-ids",
        "/v1/completions ignores `echo` and `return_token_ids` (HTTP 200, neither applied)",
        not echoed and not ids and len(content) == out["usage"]["completion_tokens"],
        f"text echoes the prompt: {str(echoed).lower()}; id fields: {', '.join(ids) or 'none'}; logprob positions "
        f"{len(content)} for {out['usage']['prompt_tokens']} prompt + {out['usage']['completion_tokens']} output tokens",
        {"serve": "off", "requests": [{"route": "/v1/completions", "body": body}]},
        expected="the prompt echoed with its logprobs, and token ids (vLLM's return_token_ids), or an HTTP 400",
        impact="specbench probes the endpoint and takes the native /completion (return_tokens) for ids; a client "
               "that trusts the 200 gets neither (the no-output-ids scenario: CANNOT TEST)",
        evidence={"echoed": echoed, "id_fields": ids, "logprob_positions": len(content), "usage": out["usage"]})
