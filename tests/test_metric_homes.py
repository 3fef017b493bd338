"""One home per rule (issue 46, point 3): a live object and a stored record compute each metric through the same
function and agree to the bit; the engine and the lossless suite agree on a model's EOS ids; the adapters' one
rule for exact chunk counts serves the run checks and the metrics audit."""

from __future__ import annotations

import json
import shutil

from specbench.suites.lossless.checks import eos_ids_of


# ---- EOS ids: the engine's set and the lossless suite's ----------------------------------------------------
def engine_eos(model_dir: str) -> set[int]:
    from specbench.engine.output import eos_ids
    from specbench.engine.tokenizer import Tokenizer

    return eos_ids(model_dir, Tokenizer(model_dir))


def test_eos_ids_of_the_bundled_pair_agree(tiny_pair) -> None:
    target, _ = tiny_pair
    assert engine_eos(target) == eos_ids_of({"model": target}) == {4090, 4092}


def _model_dir(tmp_path, target: str, config_eos, generation_eos, eos_token) -> str:
    d = tmp_path / "m"
    shutil.copytree(target, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = config_eos
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["eos_token"] = eos_token
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return str(d)


def test_eos_ids_with_a_list_valued_eos_and_the_tokenizers_own(tiny_pair, tmp_path) -> None:
    """generation_config's eos_token_id a list, config.json's an int, and the tokenizer's EOS in neither: the suite
    used to leave the tokenizer's out and so missed tokens after it; both now give the three sources' union."""
    target, _ = tiny_pair
    d = _model_dir(tmp_path, target, 4092, [4092, 7], {"content": "<|endoftext|>", "special": True})
    want = {4092, 7, 4090}  # 4090: <|endoftext|>, the tokenizer's EOS, named by neither config
    assert engine_eos(d) == eos_ids_of({"model": d}) == want


def test_eos_ids_ignore_what_is_not_an_id(tiny_pair, tmp_path) -> None:
    target, _ = tiny_pair
    d = _model_dir(tmp_path, target, [4092, "x", 1.5, True], None, None)
    (tmp_path / "m" / "generation_config.json").write_text("{not json")
    assert engine_eos(d) == eos_ids_of({"model": d}) == {4092}
