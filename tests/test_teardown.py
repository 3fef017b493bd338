"""Teardown (engine/teardown.py): close() and `del llm` free every weight, KV page and engine part without
the cycle collector (issue 19). The collector is switched off in each test, so only reference counting frees."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from specbench.engine import LLM, LLMEngine, SamplingParams
from specbench.engine.config import EngineConfig, SpecConfig
from specbench.engine.teardown import EngineClosed
from specbench.harness.fixtures import bundled_pair

TARGET, DRAFT = (str(p) for p in bundled_pair())
SP = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def probes(engine: LLMEngine) -> dict[str, weakref.ref]:
    """Weak references to what must die with the engine: weights, KV pools, the big parts."""
    r = engine.runner
    refs = {"target weight": engine.model.embed, "target module": engine.model, "runner": r,
            "kv page pool": r.kv[0][0], "scheduler": engine.scheduler}
    if engine.proposer is not None:
        refs["proposer"] = engine.proposer
    if engine.draft_model is not None:
        refs["draft module"] = engine.draft_model
        refs["draft weight"] = next(iter(engine.draft_model.parameters()))
    if getattr(r, "draft_kv", None):
        refs["draft kv"] = r.draft_kv[0][0]
    return {k: weakref.ref(v) for k, v in refs.items()}


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [k for k, w in refs.items() if w() is not None]


def test_the_engine_holds_cycles_so_dropping_it_alone_frees_nothing(no_gc) -> None:
    """Why close() exists: without it the parts outlive the last reference until the collector runs."""
    eng = LLMEngine(EngineConfig(model=TARGET, draft=DRAFT, spec=SpecConfig(method="dflash")))
    eng.generate(["hello there"], SP)
    refs = probes(eng)
    del eng
    assert alive(refs), "no reference cycle left: the test below would prove nothing"
    gc.collect()
    assert not alive(refs)


@pytest.mark.parametrize("spec", ["dflash", "off"])
def test_del_llm_frees_everything_without_the_collector(no_gc, spec) -> None:
    llm = LLM(TARGET, draft=DRAFT if spec == "dflash" else None, spec=spec)
    outs = llm.generate(["The quick brown fox", "Once upon a time"], SP)
    refs = probes(vars(llm)["_engine"])  # not `.engine`: taking the engine out keeps it open past del
    del llm
    assert not alive(refs), f"still alive after del llm: {alive(refs)}"
    assert all(len(o.output_ids) == 12 and o.prompt_ids for o in outs), "returned outputs must survive teardown"


def test_an_engine_taken_out_of_its_llm_stays_open() -> None:
    """`eng = LLM(...).engine`: the LLM dies at once, the engine must not be closed under its holder."""
    eng = LLM(TARGET, draft=DRAFT).engine
    assert eng.generate(["hello there"], SP)[0].output_ids
    eng.close()
    with pytest.raises(EngineClosed):
        eng.generate(["hello there"], SP)


def test_close_then_reuse_refused_and_a_second_engine_starts(no_gc) -> None:
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    with LLM(TARGET, draft=DRAFT) as llm:
        first = llm.generate(["Question: what is 2 + 2?"], sp)[0].output_ids
        refs = probes(llm.engine)
        tok = llm.tokenizer
    assert not alive(refs), f"still alive after the with block: {alive(refs)}"
    assert tok.decode(first) is not None  # what the user kept (tokenizer, params) still works
    with pytest.raises(EngineClosed, match="closed"):
        llm.generate(["again"], sp)
    llm.close()  # idempotent
    again = LLM(TARGET, draft=DRAFT)
    assert again.generate(["Question: what is 2 + 2?"], sp)[0].output_ids == first
    again.close()


def test_close_with_requests_in_flight(no_gc) -> None:
    llm = LLM(TARGET, draft=DRAFT)
    rid = llm.engine.add_request("a request that never finishes", SamplingParams(max_tokens=500))
    llm.engine.step()
    refs = probes(llm.engine)
    assert rid
    llm.close()
    assert not alive(refs), f"still alive after close with a request in flight: {alive(refs)}"
