"""Adapter capabilities (harness/adapters/base.py): the local adapter offers fault injection and a decode
window; remote and transformers adapters decline with a typed error naming the capability and the adapter."""

from __future__ import annotations

import pytest

from specbench.harness.adapters.base import (
    CAPABILITIES,
    DECODE_WINDOW,
    FAULTS,
    ORACLE_DRAFTS,
    EngineAdapter,
    GenRequest,
    UnsupportedCapability,
)
from specbench.harness.adapters.local import LocalAdapter


def _declines(ad: EngineAdapter) -> None:
    assert ad.capabilities == frozenset()
    for cap, call in ((FAULTS, lambda: ad.armable_faults()), (FAULTS, lambda: ad.with_faults(("kv_offset",))),
                      (DECODE_WINDOW, lambda: ad.decode_window(["x"], 4)),
                      (ORACLE_DRAFTS, lambda: ad.with_oracle_drafts({(1,): [2]}))):
        with pytest.raises(UnsupportedCapability) as e:
            call()
        assert e.value.capability == cap and e.value.adapter_kind == ad.kind and e.value.adapter_name == ad.name
        assert repr(cap) in str(e.value) and ad.kind in str(e.value) and "local" in str(e.value)


def test_openai_adapter_declines() -> None:
    from specbench.harness.adapters.openai_api import OpenAIAdapter

    _declines(OpenAIAdapter("http://127.0.0.1:9/v1", name="remote"))


def test_hf_adapter_declines() -> None:
    from specbench.harness.adapters.hf import HFAdapter

    ad = HFAdapter.__new__(HFAdapter)  # the capabilities need no weights: skip loading them
    EngineAdapter.__init__(ad, "peer")
    _declines(ad)


@pytest.fixture(scope="module")
def local(tiny_pair):
    ad = LocalAdapter.from_dirs(tiny_pair[0], draft=tiny_pair[1], spec="dflash", num_pages=64, name="cand")
    yield ad
    ad.close()


def test_local_faults(local: LocalAdapter) -> None:
    assert local.capabilities == frozenset(CAPABILITIES)
    faults = local.armable_faults()
    assert {"kv_offset", "biased_accept"} <= set(faults) and all(faults.values())
    armed = local.with_faults(("kv_offset",))
    try:
        assert armed.name == "cand[kv_offset]" and armed.describe()["config"]["faults"] == ["kv_offset"]
        assert armed.engine.cfg.with_(faults=()) == local.engine.cfg  # the same engine otherwise
    finally:
        armed.close()
    clean = local.with_faults((), name="fresh")
    try:
        assert clean.name == "fresh" and clean.describe()["config"]["faults"] == [] and clean.engine is not local.engine
    finally:
        clean.close()


def test_local_decode_window_holds_the_loop(local: LocalAdapter) -> None:
    with local.decode_window(["Question: 1 + 1?\nAnswer:", "Question: 2 + 2?\nAnswer:"], 12, warmup=1) as w:
        assert w.device == "cpu" and w.phase_ranges is False and w.busy
        sched = local.engine.scheduler
        assert not sched.waiting and not any(r.in_prefill for r in sched.running)  # past prefill
        # nothing else may step the engine while the window is open
        res = local.generate_sync([GenRequest(prompt="hi", max_tokens=2)])[0]
        assert not res.ok and "held" in (res.error or "")
        assert w.step() >= 2  # one token per request at least
    h = local.run(local.health())
    assert h["running"] == 0 and h["kv_free_pages"] == h["kv_total_pages"]  # aborted on exit
    assert local.generate_sync([GenRequest(prompt="hi", max_tokens=2)])[0].ok  # the loop serves again
