"""One home per rule (issue 46, point 3): a live object and a stored record compute each metric through the same
function and agree to the bit; the engine and the lossless suite agree on a model's EOS ids; the adapters' one
rule for exact chunk counts serves the run checks and the metrics audit."""

from __future__ import annotations

import json
import shutil

import pytest

from specbench.harness.adapters.base import GenResult, counted_exactly
from specbench.suites.lossless.checks import count_problems, eos_ids_of
from specbench.suites.metrics_audit import client_view


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


# ---- exact chunk counts: one rule for the run checks and the metrics audit --------------------------------
@pytest.mark.parametrize("method, exact", [
    ("engine", True), ("token_ids", True), ("logprobs", True), ("usage", True), ("logprobs+token_ids", True),
    ("proportional", False), ("chunks", False), ("token_ids+chunks", False), (None, False), ("", False),
])
def test_counted_exactly_serves_both_users(method: str | None, exact: bool) -> None:
    assert counted_exactly(method) is exact
    r = GenResult(rid="r", ok=True, completion_tokens=3, chunk_tokens=[1, 2], token_count_method=method or "")
    assert client_view([r])["exact_chunks"] is exact


def test_streamed_chunks_that_disagree_with_the_ids_are_a_count_problem() -> None:
    """A token-id stream whose chunks carried 4 tokens for 3 returned ids is flagged (the former copy of the rule
    knew "engine" and a method no adapter reports, so remote streams were never checked); a healthy stream and an
    estimate (proportional counts prove nothing) are not."""
    def res(chunks: list[int], method: str) -> GenResult:
        return GenResult(rid="r", ok=True, output_ids=[5, 6, 7], completion_tokens=3, chunk_tokens=chunks,
                         token_count_method=method)

    assert count_problems(res([1, 3], "token_ids")) == ["streamed chunks carried 4 tokens, 3 returned"]
    assert count_problems(res([1, 3], "logprobs+token_ids")) == ["streamed chunks carried 4 tokens, 3 returned"]
    assert count_problems(res([1, 2], "token_ids")) == []
    assert count_problems(res([1, 3], "proportional")) == []
