"""bf16 golden gate against HF transformers (REFERENCE.md section 2) for every GPU pass, and graph replay
bit-identical to eager.

Passes: FlashInfer (decode steps by its decode kernels, its tensor-core kernels, or the Triton split-K kernel
of kernels/decode_attention.py) and torch attention, each eager and with decode graphs, on a batch of 9 greedy
requests with staggered max_tokens (9 rows ride in the 16 bucket, then 8, 4, 2, 1 as requests finish), and the same
prompts one at a time. Gate per pass: HF scores the engine's continuation teacher-forced (top-64); the
engine's pick has argmax regret <= 0.20 nat at every position; over the engine's top-8 tokens that HF also
ranks in its top-64, |delta logprob| has mean <= 0.06 and p99 <= 0.20.

Model: a random Qwen3 with Qwen3-4B's head geometry (head_dim 128, 4 query heads per KV head) at a small
width, so FlashInfer runs its real kernels (tests/qwen3_random.py); the bundled tiny pair too when present.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

# (backend, eager); flashinfer-tc: FlashInfer with decode_tensor_cores (its FA2 kernels for decode steps);
# flashinfer-tritondecode: FlashInfer with decode_attention="triton" (the split-K Triton kernel for decode steps)
MODES = [("flashinfer", True), ("flashinfer", False), ("flashinfer-tc", True), ("flashinfer-tc", False),
         ("flashinfer-tritondecode", True), ("flashinfer-tritondecode", False), ("torch", True), ("torch", False)]
N_REQ = 9


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from qwen3_random import write_random_qwen3

    return str(write_random_qwen3(tmp_path_factory.mktemp("golden") / "m", vocab=4096, hidden=1024, layers=4,
                                  heads=16, kv_heads=4, head_dim=128, inter=2816, max_pos=8192,
                                  dtype=torch.bfloat16))


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()


def _requests(vocab: int):
    from specbench.engine import SamplingParams

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, vocab, (5 + 7 * i,), generator=g).tolist() for i in range(N_REQ)]
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True, logprobs=8) for i in range(N_REQ)]
    return prompts, params


def _engine(path: str, backend: str, eager: bool):
    from specbench.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=path, device="cuda", dtype="bfloat16", attention_backend=backend.split("-")[0],
                                  decode_tensor_cores=backend.endswith("-tc"), eager=eager, max_num_seqs=16,
                                  decode_attention="triton" if backend.endswith("-tritondecode") else "flashinfer",
                                  num_pages=1024))


def _run(path: str, backend: str, eager: bool, one_at_a_time: bool = False) -> tuple[list, dict]:
    eng = _engine(path, backend, eager)
    prompts, params = _requests(eng.mcfg.vocab_size)
    if one_at_a_time:
        outs = [eng.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    else:
        outs = eng.generate(prompts, params)
    g = eng.runner.graphs
    info = {"backend": eng.runner.backend.name, "ops": type(eng.runner.model.ops).__name__,
            "decode_attention": getattr(eng.runner.backend, "decode_attention", None),
            "captured": bool(g is not None and g.capture), "graph_runner": g is not None}
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return outs, info


@torch.inference_mode()
def _gate(hf, outs) -> dict:
    regrets, deltas = [], []
    for o in outs:
        ids = o.prompt_ids + o.output_ids
        x = torch.tensor([ids[:-1]], device="cuda")
        lp = torch.log_softmax(hf(input_ids=x).logits[0].float(), dim=-1)[len(o.prompt_ids) - 1:]
        top_v, top_i = torch.topk(lp, 64, dim=-1)
        for j, (tok, (_, top8)) in enumerate(zip(o.output_ids, o.logprobs, strict=True)):
            regrets.append(float(top_v[j, 0] - lp[j, tok]))
            hf_top = set(top_i[j].tolist())
            deltas += [abs(v - float(lp[j, t])) for t, v in top8.items() if t in hf_top]
    d = torch.tensor(deltas)
    return {"max_regret": max(regrets), "mean": float(d.mean()), "p99": float(torch.quantile(d, 0.99)),
            "n_positions": len(regrets), "n_pairs": len(deltas)}


def _assert_gate(stats: dict, what: str) -> None:
    assert stats["max_regret"] <= 0.20, f"{what}: argmax regret {stats}"
    assert stats["mean"] <= 0.06 and stats["p99"] <= 0.20, f"{what}: logprob deltas {stats}"


@pytest.fixture(scope="module")
def runs(model_dir):
    return {m: _run(model_dir, *m) for m in MODES}


@pytest.fixture(scope="module")
def hf(model_dir):
    m = _hf(model_dir)
    yield m
    del m
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mode", MODES, ids=[f"{b}-{'eager' if e else 'graphs'}" for b, e in MODES])
def test_golden_batched(runs, hf, mode):
    outs, info = runs[mode]
    backend, eager = mode
    assert info["backend"] == backend.split("-")[0] and info["ops"] == "TritonOps" and info["graph_runner"]
    assert info["captured"] == (not eager)
    if backend.startswith("flashinfer"):
        assert info["decode_attention"] == ("triton" if backend.endswith("-tritondecode") else "flashinfer")
    stats = _gate(hf, outs)
    print(f"golden {mode} batch of {N_REQ}: {stats}")
    _assert_gate(stats, f"{mode} batched")


def test_golden_one_at_a_time(model_dir, hf):
    outs, _ = _run(model_dir, "flashinfer", False, one_at_a_time=True)
    stats = _gate(hf, outs)
    print(f"golden flashinfer graphs one at a time: {stats}")
    _assert_gate(stats, "one at a time")


@pytest.mark.parametrize("backend", ["flashinfer", "flashinfer-tc", "flashinfer-tritondecode", "torch"])
def test_graph_replay_bit_identical_to_eager(runs, backend):
    eager, _ = runs[(backend, True)]
    graphs, _ = runs[(backend, False)]
    for a, b in zip(eager, graphs, strict=True):
        assert a.output_ids == b.output_ids
        assert a.logprobs == b.logprobs, f"{backend}: replayed logprobs differ from eager ones (same batches)"


def test_bundled_tiny_golden(tiny):
    target = tiny[0]
    hf = _hf(target)
    for eager in (True, False):
        outs, info = _run(target, "torch", eager)  # head_dim 32: the torch backend (+ Triton ops)
        stats = _gate(hf, outs)
        print(f"golden tiny torch eager={eager}: {stats}")
        _assert_gate(stats, f"tiny eager={eager}")
