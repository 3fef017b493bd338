"""EngineConfig.tp_emulate: a TP-N engine's reduction order in the target's row-parallel projections, on one device.

- the split itself: o_proj and down_proj as N partial GEMMs over slices of the input dimension, summed last slice
  first, bit for bit (and different from the one-GEMM result in bf16, so the split is real);
- off (1, the default) is the one-GEMM path, bit for bit, and an engine with tp_emulate=1 gives the default
  engine's tokens and logprobs;
- every forward path goes through the split: the plain forward, the padded runner and the decode graphs' bodies
  (graph_runner=1 on the CPU), each forward two split projections per layer;
- bf16 logits move, fp32 ones stay within fp32 noise;
- bad values are refused naming the field (engine string, EngineConfig, a model whose heads do not divide).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specbench.engine.config import ConfigError, EngineConfig, ModelConfig, SamplingParams
from specbench.engine.models.layers import add_rms_norm, swiglu
from specbench.engine.models.qwen3 import Qwen3Layer

PROMPTS = ["Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:",
           "Question: A train travels 60 miles in 2 hours. What is its speed?\nAnswer:"]


def _layer(target: str, dtype: torch.dtype, seed: int = 0) -> Qwen3Layer:
    cfg = ModelConfig.from_dir(target)
    g = torch.Generator().manual_seed(seed)
    layer = Qwen3Layer(cfg)
    for name, p in list(layer.named_parameters()):
        setattr(layer, name, torch.nn.Parameter((torch.randn(p.shape, generator=g) * 0.1).to(dtype),
                                                requires_grad=False))
    return layer


def _inputs(layer: Qwen3Layer, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    cfg = layer.cfg
    attn = torch.randn(rows, cfg.num_attention_heads, cfg.head_dim, generator=g).to(dtype)
    res = torch.randn(rows, cfg.hidden_size, generator=g).to(dtype)
    return attn, res


def _split(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    k = w.shape[1] // n
    parts = [F.linear(x[:, i * k:(i + 1) * k], w[:, i * k:(i + 1) * k]) for i in range(n)]
    out = parts[n - 1]
    for i in range(n - 2, -1, -1):
        out = out + parts[i]
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_row_parallel_projections_are_split_sums_in_reverse(tiny_target, n):
    layer = _layer(tiny_target, torch.bfloat16)
    attn, res = _inputs(layer, 9, torch.bfloat16)
    one_x, one_res = layer.post_attn(attn, res.clone())
    layer.tp = n
    x, r = layer.post_attn(attn, res.clone())
    a = attn.reshape(9, -1)
    h, want_res = add_rms_norm(_split(a, layer.o_w, n), res.clone(), layer.post_norm, layer.cfg.rms_norm_eps)
    want = _split(swiglu(F.linear(h, layer.gate_up_w)), layer.down_w, n)
    assert torch.equal(x, want) and torch.equal(r, want_res)
    assert not torch.equal(x, one_x), "the split changed no bit of a bf16 output: it is not applied"
    # the residual stream after o_proj carries the split too (it is the o_proj output plus the residual)
    assert not torch.equal(r, one_res)


def test_off_is_the_one_gemm_path(tiny_target):
    layer = _layer(tiny_target, torch.bfloat16)
    assert layer.tp == 1
    attn, res = _inputs(layer, 5, torch.bfloat16)
    x, r = layer.post_attn(attn, res.clone())
    h, want_res = add_rms_norm(F.linear(attn.reshape(5, -1), layer.o_w), res.clone(), layer.post_norm,
                               layer.cfg.rms_norm_eps)
    assert torch.equal(x, F.linear(swiglu(F.linear(h, layer.gate_up_w)), layer.down_w))
    assert torch.equal(r, want_res)
    assert EngineConfig(model=tiny_target).tp_emulate == 1


def _generate(target: str, **kw) -> list:
    from specbench.engine import LLM

    llm = LLM(target, **kw)
    try:
        return llm.generate(PROMPTS, SamplingParams(max_tokens=12, logprobs=5))
    finally:
        llm.close()


def _max_logprob_diff(a: list, b: list) -> float:
    diff = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        for (lx, _), (ly, _) in zip(x.logprobs, y.logprobs, strict=True):
            diff = max(diff, abs(lx - ly))
    return diff


def test_engine_off_gives_the_default_tokens_and_logprobs(tiny_target):
    default = _generate(tiny_target, spec="off")
    off = _generate(tiny_target, spec="off", tp_emulate=1)
    assert _max_logprob_diff(default, off) == 0.0


def test_engine_bf16_moves_fp32_stays_within_noise(tiny_target):
    """bf16: the chosen tokens' logprobs move (two partial results each rounded to bf16, then summed);
    fp32: they move by fp32 rounding only."""
    fp = [_generate(tiny_target, spec="off", tp_emulate=n) for n in (1, 2)]
    assert _max_logprob_diff(*fp) < 1e-4
    bf = [_generate(tiny_target, spec="off", dtype="bfloat16", tp_emulate=n) for n in (1, 2)]
    moved = False
    for x, y in zip(*bf, strict=True):
        moved = moved or len(x.output_ids) != len(y.output_ids)
        for a, b, (lx, _), (ly, _) in zip(x.output_ids, y.output_ids, x.logprobs, y.logprobs, strict=False):
            moved = moved or a != b or lx != ly
            if a != b:  # the continuations differ after a flip
                break
    assert moved, "tp_emulate=2 left every bf16 logprob unchanged: the split does not reach the engine"


@pytest.mark.parametrize("spec", ["off", "dflash"])
def test_every_forward_path_runs_the_split(tiny_pair, monkeypatch, spec):
    """graph_runner=1 on the CPU: the decode graphs' bodies (spec off: decode ahead) and the padded verify / prefill
    runner (spec on) run eagerly; in every path each layer's post_attn makes its 2 projections split."""
    from specbench.engine import LLM
    from specbench.engine.graphs import DecodeGraphs, VerifyGraphs

    target, draft = tiny_pair
    calls = {"n": 0}
    path: list[str] = ["plain"]
    seen: dict[str, set[int]] = {}
    split, post = Qwen3Layer.row_parallel, Qwen3Layer.post_attn

    def counting(self, *a, **k):
        calls["n"] += 1
        return split(self, *a, **k)

    def post_attn(self, *a, **k):
        before = calls["n"]
        out = post(self, *a, **k)
        who = path[-1] if self.tp > 1 else "drafter"  # the DFlash drafter's layers are Qwen3Layers too, never split
        seen.setdefault(who, set()).add(calls["n"] - before)
        return out

    def entering(label: str, fn):
        def run(self, *a, **k):
            path.append(label)
            try:
                return fn(self, *a, **k)
            finally:
                path.pop()
        return run

    monkeypatch.setattr(Qwen3Layer, "row_parallel", counting)
    monkeypatch.setattr(Qwen3Layer, "post_attn", post_attn)
    monkeypatch.setattr(DecodeGraphs, "launch", entering("decode-graph", DecodeGraphs.launch))
    monkeypatch.setattr(VerifyGraphs, "run", entering("padded", VerifyGraphs.run))
    kw = {"draft": draft} if spec == "dflash" else {}
    llm = LLM(target, spec=spec, graph_runner=True, tp_emulate=2, **kw)
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=12))
        assert [ly.tp for ly in llm._engine.model.layers] == [2] * llm._engine.mcfg.num_hidden_layers
    finally:
        llm.close()
    assert ("decode-graph" if spec == "off" else "padded") in seen, seen.keys()
    assert seen.pop("drafter", {0}) == {0}, "a drafter layer split its projections"
    assert all(d == {2} for d in seen.values()), seen


def test_bad_values_are_refused_by_name(tiny_target):
    from specbench.engine import LLM
    from specbench.harness.engines import EngineStringError, parse_engine

    assert parse_engine("local,tp_emulate=2").options["tp_emulate"] == "2"
    for bad in ("0", "-2", "two"):
        with pytest.raises(EngineStringError, match="tp_emulate"):
            parse_engine(f"local,tp_emulate={bad}")
    with pytest.raises(ConfigError, match="tp_emulate"):
        EngineConfig(model=tiny_target, tp_emulate=0)
    with pytest.raises(ConfigError, match=r"tp_emulate=3 .*num_attention_heads=4"):
        LLM(tiny_target, spec="off", tp_emulate=3)
