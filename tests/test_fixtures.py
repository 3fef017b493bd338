"""The fixtures: the committed tiny pair loads everywhere a real checkpoint would, the tokenizer round
trips, builds are deterministic for a seed, and the Qwen3-4B-shaped writer matches the real format."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer import Typer
from typer.testing import CliRunner

from specbench.cli.fixtures import fixtures
from specbench.engine.config import ModelConfig
from specbench.engine.models.dflash import DFlashDraftModel
from specbench.engine.models.qwen3 import Qwen3ForCausalLM
from specbench.harness.fixtures import (
    FixturesMissing,
    TinySettings,
    build_qwen3_4b_shape,
    build_tiny_pair,
    bundled_pair,
    ensure_bundled,
    read_build_info,
)
from specbench.harness.fixtures.accept import greedy_generate, measure_acceptance, target_data
from specbench.harness.fixtures.data import gsm8k, prompt
from specbench.harness.fixtures.shape4b import QWEN3_4B, QWEN3_4B_DFLASH_B16, draft_shapes, target_shapes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TARGET, DRAFT = bundled_pair()
SMALL = {"hidden_size": 32, "intermediate_size": 48, "head_dim": 8}


def _names(d: Path) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    return out


def test_bundled_pair_is_in_the_installed_package() -> None:
    root = resources.files("specbench.harness") / "data" / "fixtures" / "tiny"
    # resolve(): the package is reached through the specbench/<pkg> links (pyproject.toml, [tool.mypy])
    assert Path(str(root / "target")).resolve() == TARGET and Path(str(root / "draft")).resolve() == DRAFT
    assert ensure_bundled() == (TARGET, DRAFT)
    info = read_build_info(TARGET.parent)
    assert info["seed"] == 0 and info["acceptance"]["mean_accept_len"] >= 2.0


def test_ensure_bundled_names_the_missing_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import specbench.harness.fixtures as fx

    monkeypatch.setattr(fx, "BUNDLED_DIR", tmp_path)
    with pytest.raises(FixturesMissing, match="config.json is missing"):
        fx.ensure_bundled()


def test_target_loads_with_hf_and_engine_and_agrees() -> None:
    from transformers import Qwen3ForCausalLM as HFQwen3

    hf, info = HFQwen3.from_pretrained(TARGET, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    cfg = ModelConfig.from_dir(TARGET)
    assert cfg.tie_word_embeddings and cfg.vocab_size % 64 == 0 and cfg.num_hidden_layers == 4
    ours = Qwen3ForCausalLM.load(TARGET, cfg, torch.float32, "cpu")
    assert torch.equal(ours.embed, hf.model.embed_tokens.weight)
    assert ours.lm_head_w is ours.embed


def test_drafter_loads_in_z_lab_format() -> None:
    raw = json.loads((DRAFT / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    tcfg, dcfg = ModelConfig.from_dir(TARGET), ModelConfig.from_dir(DRAFT)
    assert dcfg.block_size == 8 and dcfg.num_target_layers == tcfg.num_hidden_layers
    from tokenizers import Tokenizer

    assert dcfg.mask_token_id == Tokenizer.from_file(str(TARGET / "tokenizer.json")).token_to_id("<|MASK|>")
    names = set(_names(DRAFT))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.gate_proj.weight"} <= names
    assert not any(n.startswith(("model.", "embed", "lm_head")) for n in names)
    d = DFlashDraftModel.load(DRAFT, dcfg, tcfg, torch.float32, "cpu")
    assert d.fc_w.shape == (tcfg.hidden_size, len(dcfg.target_layer_ids or ()) * tcfg.hidden_size)


def test_tokenizer_round_trip() -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(TARGET)
    raw = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    text = prompt(gsm8k("test")[0]["question"]) + " 48/2 = <<48/2=24>>24\n#### 24<|endoftext|>"
    ids = hf(text)["input_ids"]
    assert ids == raw.encode(text).ids and hf.decode(ids) == text and ids[-1] == hf.eos_token_id
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"):
        assert len(raw.encode(s).ids) == 1
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert len(hf) <= ModelConfig.from_dir(TARGET).vocab_size


def test_committed_drafter_accepts_on_gsm8k_test() -> None:
    """A small replay of the build's acceptance measurement through the engine-loaded drafter."""
    from transformers import AutoTokenizer
    from transformers import Qwen3ForCausalLM as HFQwen3

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(TARGET)
    hf = HFQwen3.from_pretrained(TARGET, dtype=torch.float32).eval()
    tcfg, dcfg = ModelConfig.from_dir(TARGET), ModelConfig.from_dir(DRAFT)
    drafter = DFlashDraftModel.load(DRAFT, dcfg, tcfg, torch.float32, "cpu")
    prompts = [tok(prompt(r["question"]))["input_ids"] for r in gsm8k("test")[:4]]
    seqs = [greedy_generate(hf, [p], 48, tok.eos_token_id)[0] for p in prompts]
    data = target_data(hf, seqs, [len(p) for p in prompts], list(dcfg.target_layer_ids or ()))
    acc = measure_acceptance(drafter, hf.model.embed_tokens.weight.detach(), data)
    assert acc["mean_accept_len"] >= 2.0
    assert all(a >= b for a, b in zip(acc["per_position"], acc["per_position"][1:], strict=False))


TINY = TinySettings(target_steps=2, target_batch=2, target_seq_len=32, draft_steps=2, distill_prompts=4,
                    distill_new_tokens=8, draft_seqs_per_step=4, draft_anchors_per_seq=2)


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != "BUILD.json"}


def test_build_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = _files(build_tiny_pair(tmp_path / "a", seed=0, settings=TINY, log=None, measure=False)[0].parent)
    b = _files(build_tiny_pair(tmp_path / "b", seed=0, settings=TINY, log=None, measure=False)[0].parent)
    c = _files(build_tiny_pair(tmp_path / "c", seed=1, settings=TINY, log=None, measure=False)[0].parent)
    assert a.keys() == b.keys() == c.keys() and "draft/model.safetensors" in a
    assert a == b
    assert a["target/model.safetensors"] != c["target/model.safetensors"]
    assert a["draft/model.safetensors"] != c["draft/model.safetensors"]


def test_qwen3_4b_shape_scaled_down_is_a_real_format_checkpoint(tmp_path: Path) -> None:
    tdir, ddir = build_qwen3_4b_shape(tmp_path, seed=0, overrides=SMALL, shard_bytes=4 << 20)
    traw, draw = (json.loads((d / "config.json").read_text()) for d in (tdir, ddir))
    for k, v in QWEN3_4B.items():
        assert traw[k] == SMALL.get(k, v), k
    for k, v in QWEN3_4B_DFLASH_B16.items():
        assert draw[k] == SMALL.get(k, v), k
    assert draw["block_size"] == 16 and draw["dflash_config"] == {
        "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    index = json.loads((tdir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    tnames, dnames = _names(tdir), _names(ddir)
    assert tnames == dict(target_shapes(traw)) and "lm_head.weight" not in tnames
    assert dnames == dict(draft_shapes(draw, traw["hidden_size"]))
    assert len(dnames) == 3 + 5 * 11 and dnames["fc.weight"] == (32, 5 * 32)
    # at full size the same code gives REFERENCE.md's shapes
    full = dict(draft_shapes(QWEN3_4B_DFLASH_B16, 2560))
    assert full["fc.weight"] == (2560, 12800) and full["layers.4.self_attn.q_proj.weight"] == (4096, 2560)
    assert full["layers.0.self_attn.k_proj.weight"] == (1024, 2560) and full["layers.0.mlp.down_proj.weight"] == (2560, 9728)
    assert sum(torch.Size(s).numel() for s in full.values()) == pytest.approx(537e6, rel=0.01)
    tcfg, dcfg = ModelConfig.from_dir(tdir), ModelConfig.from_dir(ddir)
    Qwen3ForCausalLM.load(tdir, tcfg, torch.bfloat16, "cpu")
    d = DFlashDraftModel.load(ddir, dcfg, tcfg, torch.bfloat16, "cpu")
    assert d.block_size == 16 and d.mask_token_id == 151669 and d.target_layer_ids == (1, 9, 17, 25, 33)
    again = tmp_path / "again"
    build_qwen3_4b_shape(again, seed=0, overrides=SMALL, shard_bytes=4 << 20)
    assert (again / "draft" / "model.safetensors").read_bytes() == (ddir / "model.safetensors").read_bytes()


def test_shape_overrides_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        build_qwen3_4b_shape(tmp_path, overrides={"num_hidden_layers": 2})


def test_cli_refuses_an_unknown_shape(tmp_path: Path) -> None:
    app = Typer()
    app.command()(fixtures)
    app.command("noop")(lambda: None)  # two commands, so `fixtures` is addressed by name as in the real CLI
    res = CliRunner().invoke(app, ["fixtures", "--out", str(tmp_path), "--shape", "qwen3-5b"])
    assert res.exit_code == 2 and "--shape" in res.output and "tiny" in res.output
    res = CliRunner().invoke(app, ["fixtures", "--help"])
    assert res.exit_code == 0 and "qwen3-4b" in res.output
