"""EOS ids of a remote endpoint for the lossless suite's after-eos check (suites/lossless/checks.py `eos_ids_of`)."""

from __future__ import annotations

from specbench.engine import EngineConfig, LLMEngine
from specbench.harness.adapters.openai_api import OpenAIAdapter
from specbench.harness.server import ServerThread, make_app


def test_an_endpoints_eos_ids_come_from_the_root_its_models_report(tiny_pair, tmp_path) -> None:
    """The after-eos check on a remote endpoint (vLLM, `specbench serve`) on this host: /v1/models' `root` is the
    model directory, so its EOS ids are known; a root that is not here leaves them unknown (the check is skipped
    and says so), never guessed."""
    from specbench.suites.lossless.checks import eos_ids_of

    target, _ = tiny_pair
    local = eos_ids_of({"model": target})
    assert local
    assert eos_ids_of({"model": "tiny", "server": {"models": [{"id": "tiny", "root": target}]}}) == local
    assert eos_ids_of({"model": "tiny", "config": {"tokenizer": target}}) == local
    assert eos_ids_of({"model": "tiny", "server": {"models": [{"id": "tiny", "root": str(tmp_path / "gone")}]}}) == set()
    assert eos_ids_of({"model": "tiny", "server": {"models": [{"id": "tiny", "root": str(tmp_path)}]}}) == set()
    eng = LLMEngine(EngineConfig(model=target, num_pages=64))
    app, loop = make_app(eng, served_name="tiny")
    srv = ServerThread(app).start()
    remote = OpenAIAdapter(srv.url + "/v1", model="tiny")
    try:
        assert eos_ids_of(remote.describe()) == local
    finally:
        remote.close()
        srv.stop()
        loop.close()
