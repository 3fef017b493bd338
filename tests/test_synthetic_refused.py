"""Synthetic acceptance (engine/spec/synthetic.py) draws how many drafts are accepted, so its outputs are not the
target's: the lossless and sampled gates refuse such an engine up front, local (`tau=`) or a `specbench serve
--synthetic-tau` server (its /v1/models says so), instead of reporting a FAIL that blames the engine."""

from __future__ import annotations

import pytest

from specbench.engine import EngineConfig, LLMEngine, SpecConfig
from specbench.harness.adapters.base import refuse_synthetic, synthetic_tau_of
from specbench.harness.adapters.local import LocalAdapter
from specbench.harness.adapters.openai_api import OpenAIAdapter
from specbench.harness.server import ServerThread, make_app
from specbench.suites.lossless.greedy import LosslessError
from specbench.suites.lossless.suite import LosslessConfig, run_lossless
from specbench.suites.sampled.config import SampledError, SampledGateOptions
from specbench.suites.sampled.gate import run_gate


def test_tau_is_read_from_a_local_config_and_from_a_servers_models() -> None:
    assert synthetic_tau_of({"config": {"synthetic_tau": 3.5}}) == 3.5
    assert synthetic_tau_of({"config": {"synthetic_tau": None}}) is None
    assert synthetic_tau_of({"server": {"models": [{"id": "m", "synthetic_tau": 6.5}]}}) == 6.5
    assert synthetic_tau_of({"server": {"models": [{"id": "m"}]}, "config": {"base_url": "x"}}) is None
    with pytest.raises(ValueError, match="candidate runs synthetic acceptance \\(tau=2"):
        refuse_synthetic({"baseline": {}, "candidate": {"config": {"synthetic_tau": 2.0}}}, "x", ValueError)


def test_the_gates_refuse_a_synthetic_server_and_a_synthetic_local_engine(tiny_pair) -> None:
    target, draft = tiny_pair
    eng = LLMEngine(EngineConfig(model=target, draft=draft, num_pages=128,
                                 spec=SpecConfig(method="dflash", synthetic_tau=3.0)))
    app, loop = make_app(eng, served_name="tiny")
    srv = ServerThread(app).start()
    base = LocalAdapter.from_dirs(target, spec="off", num_pages=128)
    remote = OpenAIAdapter(srv.url + "/v1", model="tiny")
    local = LocalAdapter.from_dirs(target, draft, spec="dflash", num_pages=128, synthetic_tau=3.0)
    try:
        assert remote.describe()["server"]["models"][0]["synthetic_tau"] == 3.0
        import asyncio

        for cand in (remote, local):
            with pytest.raises(LosslessError, match="candidate runs synthetic acceptance"):
                asyncio.run(run_lossless(base, cand, LosslessConfig(num_prompts=1, max_tokens=4)))
            with pytest.raises(SampledError, match="runs synthetic acceptance"):
                run_gate(base, cand, SampledGateOptions(num_prompts=1, samples=8, positions=2))
    finally:
        remote.close()
        srv.stop()
        loop.close()

