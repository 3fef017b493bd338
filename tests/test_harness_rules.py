"""One home per rule on the harness side: the spec method, the spec-off twin, the two arms, the gsm8k prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from specbench.engine.config import engine_method, spec_method
from specbench.harness.datasets import bundled_prompts, gsm8k_prompt
from specbench.harness.engines import (
    EngineStringError,
    baseline_and_candidate,
    default_engines,
    parse_engine,
    spec_off_twin,
)


def test_spec_method() -> None:
    """The one rule (engine/config.py; tests/test_spec_method_home.py holds every front door to it)."""
    assert spec_method(None, "/d") == "dflash" and spec_method(None, None) == "off"
    assert spec_method("auto", "/d") == "dflash" and spec_method("auto", None) == "off"
    assert spec_method("on", "/d") == "dflash" and spec_method("on", None) == "ngram"
    assert spec_method("ngram", "/d") == "ngram" and spec_method("off", "/d") == "off"
    assert engine_method("off") is None and engine_method("dflash") == "dflash"
    with pytest.raises(ValueError, match="spec='maybe'"):
        spec_method("maybe", None)


def test_spec_off_twin_keeps_the_engine_drops_speculation(tmp_path: Path) -> None:
    cand = parse_engine(f"local:{tmp_path},draft={tmp_path},spec=dflash,k=3,dtype=bfloat16,num_pages=9,"
                        "eager=0,faults=kv_offset,tau=2,name=x")
    twin = spec_off_twin(cand)
    assert twin.options == {"dtype": "bfloat16", "num_pages": "9", "eager": "0", "spec": "off", "name": "baseline"}
    assert parse_engine(twin.raw).options == {k: v for k, v in twin.options.items() if k != "name"}
    assert spec_off_twin(parse_engine("local,spec=ngram")).raw == "local,spec=off"
    with pytest.raises(EngineStringError, match="local"):
        spec_off_twin(parse_engine("openai:http://127.0.0.1:9/v1"))


def test_default_engines_are_a_twin_pair() -> None:
    base, cand = default_engines()
    assert base == spec_off_twin(cand) and base.options == {"spec": "off", "name": "baseline"}
    assert cand.options["spec"] in ("dflash", "ngram") and cand.options["name"] == "candidate"


def test_baseline_and_candidate(tmp_path: Path) -> None:
    assert baseline_and_candidate(None, None) == default_engines()
    b, c = baseline_and_candidate(None, f"local:{tmp_path},spec=ngram")
    assert b == spec_off_twin(c)
    b, c = baseline_and_candidate("openai:http://h:1/v1", "openai:http://h:2/v1")
    assert (b.target, c.target) == ("http://h:1/v1", "http://h:2/v1")
    with pytest.raises(EngineStringError, match="--candidate"):
        baseline_and_candidate("local", None)
    with pytest.raises(EngineStringError, match="--baseline"):
        baseline_and_candidate(None, "openai:http://h:2/v1")


def test_gsm8k_prompt_is_the_bundled_format() -> None:
    from specbench.harness.fixtures.data import prompt

    assert gsm8k_prompt("q?") == "Question: q?\nAnswer:" == prompt("q?")
    pid, text = bundled_prompts("gsm8k")[0]
    assert pid == "gsm8k-0" and text.startswith("Question: ") and text.endswith("\nAnswer:")
