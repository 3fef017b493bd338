"""llama.cpp's llama-server as built and started by specbench.harness.foreign.llamacpp: the servers come up,
speak the native dialect we rely on, and greedy speculation (draft model, n-gram, DFlash) gives the same
token ids as speculation off. What llama.cpp itself gets wrong is in test_llamacpp_findings.py.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specbench.harness.foreign import llamacpp as lc

N_PREDICT = 48
N_PROMPTS = 4
SPEC = "llamacpp:spec_decode_"


def greedy(server: lc.LlamaServer, prompt: str, n: int = N_PREDICT) -> dict:
    status, body = server.post("/completion", {
        "prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False,
        "return_tokens": True, "ignore_eos": True, "seed": 0,
    })
    assert status == 200, f"{server.name}: HTTP {status} {body}"
    assert isinstance(body, dict) and len(body["tokens"]) == n, f"{server.name}: {body}"
    return body


def ids(server: lc.LlamaServer, prompts: list[str], concurrency: int = 1) -> list[list[int]]:
    with ThreadPoolExecutor(concurrency) as ex:
        return [r["tokens"] for r in ex.map(lambda p: greedy(server, p), prompts)]


@pytest.fixture(scope="module")
def prompts(gsm8k_prompts) -> list[str]:
    return gsm8k_prompts[:N_PROMPTS]


@pytest.fixture(scope="module")
def off_ids(llamacpp_off, prompts) -> list[list[int]]:
    return ids(llamacpp_off, prompts)


def test_health_and_props(llamacpp_off, llamacpp_draft, llamacpp_ngram, llamacpp_dflash, llamacpp_build):
    for s in (llamacpp_off, llamacpp_draft, llamacpp_ngram, llamacpp_dflash):
        status, body = s.get("/health")
        assert status == 200 and json.loads(body) == {"status": "ok"}, (s.name, status, body)
        status, body = s.get("/props")
        assert status == 200, (s.name, status, body)
        props = json.loads(body)
        assert lc.PIN["llama_cpp_commit"] in props["build_info"], props.get("build_info")
        assert props["total_slots"] == 4
    # /version does not exist (the build is in /props)
    assert llamacpp_off.get("/version")[0] == 404
    assert lc.PIN["llama_cpp_commit"] in llamacpp_build.info["version"]


def test_tokenize_dialect(llamacpp_off, tiny_target, prompts):
    """`/tokenize` takes {"content": ...} and gives our tokenizer's ids; other bodies give [] with HTTP 200."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_target}/tokenizer.json")
    for p in prompts:
        status, body = llamacpp_off.post("/tokenize", {"content": p})
        assert status == 200
        assert body["tokens"] == tok.encode(p, add_special_tokens=False).ids
    for wrong in ({"prompt": prompts[0]}, {"text": prompts[0]}):
        status, body = llamacpp_off.post("/tokenize", wrong)
        assert (status, body) == (200, {"tokens": []}), (wrong.keys(), status, body)


@pytest.mark.parametrize("kind", ["draft", "ngram", "dflash"])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_greedy_ids_identical_spec_on_off(kind, concurrency, request, prompts, off_ids, llamacpp_off):
    server = request.getfixturevalue(f"llamacpp_{kind}")
    assert ids(server, prompts, concurrency) == off_ids
    if concurrency == 4:
        assert ids(llamacpp_off, prompts, 4) == off_ids


def test_token_id_prompt_accepted(llamacpp_off, prompts, off_ids):
    """The native /completion takes a token-id list as the prompt and gives the same continuation."""
    _, tok = llamacpp_off.post("/tokenize", {"content": prompts[0]})
    status, body = llamacpp_off.post("/completion", {
        "prompt": tok["tokens"], "n_predict": N_PREDICT, "temperature": 0, "top_k": 1,
        "cache_prompt": False, "return_tokens": True, "ignore_eos": True})
    assert status == 200 and body["tokens"] == off_ids[0]


def _spec_counters(server: lc.LlamaServer) -> dict[str, float]:
    return {k[len(SPEC):]: v for k, v in server.metrics().items() if k.startswith(SPEC)}


@pytest.mark.parametrize("kind,lo,hi", [("draft", 0.05, 0.95), ("ngram", 0.0, 1.0), ("dflash", 0.01, 0.95)])
def test_spec_counters(kind, lo, hi, request, prompts, llamacpp_notes):
    """The four `llamacpp:spec_decode_*` counters move, and the per-request timings carry draft_n."""
    server = request.getfixturevalue(f"llamacpp_{kind}")
    before = _spec_counters(server)
    for name in ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total"):
        assert name in before, sorted(before)
    bodies = [greedy(server, p) for p in prompts]
    after = _spec_counters(server)
    drafted = after["num_draft_tokens_total"] - before["num_draft_tokens_total"]
    accepted = after["num_accepted_tokens_total"] - before["num_accepted_tokens_total"]
    per_req = sum(b["timings"].get("draft_n", 0) for b in bodies)
    per_req_acc = sum(b["timings"].get("draft_n_accepted", 0) for b in bodies)
    assert drafted > 0 and after["num_drafts_total"] > before["num_drafts_total"]
    assert (per_req, per_req_acc) == (drafted, accepted)
    per_pos = {k: v for k, v in after.items() if k.startswith("num_accepted_tokens_per_pos_total{")}
    assert per_pos, "no per-position counter"
    rate = accepted / drafted
    llamacpp_notes.append(f"llama.cpp {kind}: acceptance {accepted:.0f}/{drafted:.0f} = {rate:.1%} "
                 f"({len(prompts)} prompts x {N_PREDICT} tokens)")
    assert lo <= rate <= hi, rate
    if kind == "draft":
        assert accepted > 0


def test_wrong_model_differs(llamacpp_wrong, prompts, off_ids):
    """The deliberately broken pairing really is a different model: its greedy ids differ from the target's."""
    got = ids(llamacpp_wrong, prompts)
    assert got != off_ids
    assert sum(a != b for x, y in zip(got, off_ids, strict=True) for a, b in zip(x, y, strict=True)) > 0


def test_stop_and_lifetime(llamacpp_build, llamacpp_models, tmp_path):
    """stop() ends the process (SIGTERM) and the lifetime bound ends it without stop()."""
    s = lc.start_server("off", llamacpp_models, llamacpp_build, threads=1, log_dir=tmp_path, name="stop")
    assert s.alive()
    s.stop()
    assert not s.alive() and s.returncode is not None
    assert s.log_path.read_text().startswith("$ ")
    s = lc.start_server("off", llamacpp_models, llamacpp_build, threads=1, log_dir=tmp_path, name="life",
                        lifetime_s=2.0)
    deadline = time.monotonic() + 20
    while s.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not s.alive(), "lifetime bound did not stop the server"
    s.stop()


def test_port_taken_is_retried(llamacpp_build, llamacpp_models, llamacpp_off, tmp_path):
    """A port lost between free_port() and the bind (here: the off server's) is retried on a fresh one;
    the other server's /health 200 is not mistaken for ours."""
    s = lc.LlamaServer(llamacpp_build, llamacpp_models.target_f32, threads=1, log_dir=tmp_path, name="race")
    s._set_port(llamacpp_off.port)
    with s:
        assert s.port != llamacpp_off.port and s.alive()
        assert s.get("/health")[0] == 200
    assert not s.alive()
