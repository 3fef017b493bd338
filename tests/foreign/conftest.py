"""Session fixtures: llama.cpp's llama-server built (or taken from the cache), the tiny fixtures converted to
GGUF, and one server per speculation kind on a free loopback port (specbench.harness.foreign.llamacpp).

Fixtures (all session-scoped; the build and the conversion happen once per session, the servers start
on first use and stop at the end of the session):

    llamacpp_build     Build (bin/llama-server, bin/llama-quantize, src/, build.json)
    llamacpp_models    Models (target f32/Q8_0/Q4_0, perturbed, dflash, dflash_lasttap GGUF paths)
    llamacpp_off       spec off, the f32 target
    llamacpp_draft     draft-model speculation: the f32 target + the seeded-noise copy as drafter
    llamacpp_ngram     n-gram speculation (ngram-simple)
    llamacpp_dflash    DFlash: the f32 target + the bundled drafter re-tapped to layers [1, 2]
    llamacpp_wrong     a deliberately broken "spec off": the perturbed model, not the target
    llamacpp_notes     list of lines printed in the terminal summary (findings, acceptance)
    llamacpp_server    factory: llamacpp_server(kind, **LlamaServer kwargs) -> a started server, stopped at
                       session end (for other kinds, e.g. "q4_0", "dflash-lasttap", or other flags)

Environment: SPECBENCH_LLAMACPP=0 skips all of them; SPECBENCH_LLAMACPP=cached skips unless the build is
already cached (no 10-minute build); SPECBENCH_LLAMACPP_CACHE moves the cache. They skip, with the
reason, when no C++ toolchain exists or the pinned source cannot be fetched; a build or conversion that
fails is an error, not a skip. Every test under tests/foreign gets a 30-minute timeout, because the
first one to ask for a server pays for the build on a cold cache.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from specbench.harness.foreign import llamacpp as lc

FOREIGN_DIR = Path(__file__).resolve().parent
BUILD_TIMEOUT_S = int(os.environ.get("SPECBENCH_LLAMACPP_TEST_TIMEOUT", "1800"))
SERVER_LIFETIME_S = float(os.environ.get("SPECBENCH_LLAMACPP_LIFETIME", "3600"))

# what the fixtures cost in this session, printed in the terminal summary
TIMINGS: dict[str, float] = {}
NOTES: list[str] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "llamacpp: uses llama.cpp's llama-server (tests/foreign)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if FOREIGN_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.llamacpp)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S))


def pytest_terminal_summary(terminalreporter):
    if not TIMINGS and not NOTES:
        return
    terminalreporter.section("llama.cpp fixtures")
    for k, v in TIMINGS.items():
        terminalreporter.write_line(f"{k}: {v:.2f} s")
    for n in NOTES:
        terminalreporter.write_line(n)


@pytest.fixture(scope="session")
def llamacpp_notes() -> list[str]:
    """Lines for the terminal summary (findings, acceptance rates)."""
    return NOTES


@pytest.fixture(scope="session")
def llamacpp_build() -> lc.Build:
    mode = os.environ.get("SPECBENCH_LLAMACPP", "1").strip().lower()
    if mode in ("0", "off", "no", "false"):
        pytest.skip("llama.cpp tests disabled (SPECBENCH_LLAMACPP=0)")
    t0 = time.monotonic()
    cached = lc.cached_build()
    if cached is None:
        if mode == "cached":
            pytest.skip(f"llama.cpp not built at {lc.build_dir()} and SPECBENCH_LLAMACPP=cached "
                        "(build: python -m specbench.harness.foreign.llamacpp build)")
        why = lc.toolchain_missing()
        if why:
            pytest.skip(f"llama.cpp: {why}")
        try:
            lc.fetch_sdist()
        except lc.Unavailable as e:
            pytest.skip(f"llama.cpp source unavailable: {e}")
    b = cached or lc.ensure_build()  # a failing build raises: an error, not a skip
    TIMINGS["llamacpp build (cached)" if cached else "llamacpp build (fresh)"] = time.monotonic() - t0
    if not cached:
        NOTES.append(f"llama.cpp build: {b.info.get('total_s')} s, see {b.root / 'build.log'}")
    return b


@pytest.fixture(scope="session")
def llamacpp_models(llamacpp_build) -> lc.Models:
    t0 = time.monotonic()
    m = lc.ensure_models(llamacpp_build)
    TIMINGS["llamacpp GGUF fixtures"] = time.monotonic() - t0
    return m


@pytest.fixture(scope="session")
def llamacpp_log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llamacpp-logs")


@pytest.fixture(scope="session")
def llamacpp_server(llamacpp_build, llamacpp_models, llamacpp_log_dir):
    started: list[lc.LlamaServer] = []

    def start(kind: str, **kw) -> lc.LlamaServer:
        kw.setdefault("lifetime_s", SERVER_LIFETIME_S)
        kw.setdefault("log_dir", llamacpp_log_dir)
        t0 = time.monotonic()
        s = lc.start_server(kind, llamacpp_models, llamacpp_build, **kw)
        TIMINGS[f"llamacpp server {s.name} start"] = time.monotonic() - t0
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def _named(kind: str):
    @pytest.fixture(scope="session")
    def fixture(llamacpp_server) -> lc.LlamaServer:
        return llamacpp_server(kind)

    fixture.__doc__ = f"llama-server, kind {kind!r} (see specbench.harness.foreign.llamacpp.KINDS)"
    return fixture


llamacpp_off = _named("off")
llamacpp_draft = _named("draft")
llamacpp_ngram = _named("ngram")
llamacpp_dflash = _named("dflash")
llamacpp_wrong = _named("wrong")
