"""A small random Qwen3 checkpoint in HF format, for kernel/graph tests that need no trained fixture.

`write_random_qwen3(out, ...)` writes config.json, generation_config.json, model.safetensors (standard HF
tensor names, tied embeddings) and a word-level tokenizer.json. Weights are deterministic in `seed`.
Scales are chosen so logits are peaked (std ~2-3 nats) and norm weights are not all ones: a kernel that
drops a weight, a position or a key shows up in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_tokenizer(out: Path, vocab: int = 64) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def write_random_qwen3(out: str | Path, vocab: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4,
                       kv_heads: int = 2, head_dim: int = 16, inter: int = 128, max_pos: int = 4096, seed: int = 0,
                       dtype: torch.dtype = torch.float32) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * gain / cols ** 0.5).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.2 * torch.randn(n, generator=g)).to(dtype)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 2.5 / hidden ** 0.5).to(dtype),
                                  "model.norm.weight": norm(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = mat(heads * head_dim, hidden, 2.0)
        t[p + "self_attn.k_proj.weight"] = mat(kv_heads * head_dim, hidden, 2.0)
        t[p + "self_attn.v_proj.weight"] = mat(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = mat(hidden, heads * head_dim, 0.5)
        t[p + "self_attn.q_norm.weight"] = norm(head_dim)
        t[p + "self_attn.k_norm.weight"] = norm(head_dim)
        t[p + "mlp.gate_proj.weight"] = mat(inter, hidden)
        t[p + "mlp.up_proj.weight"] = mat(inter, hidden)
        t[p + "mlp.down_proj.weight"] = mat(hidden, inter, 0.5)
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
    save_file({k: v.contiguous() for k, v in sorted(t.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 1, "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": max_pos,
        "max_window_layers": layers, "model_type": "qwen3", "num_attention_heads": heads,
        "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "pad_token_id": 0, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 1_000_000.0, "sliding_window": None, "tie_word_embeddings": True,
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True, "use_sliding_window": False,
        "vocab_size": vocab,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 1}))
    write_tokenizer(out)
    return out
