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
    llamacpp_results   the directory the session's records go to ($SPECBENCH_LLAMACPP_RESULTS, else a temp
                       directory): the gates' results runs and foreign.jsonl (harness/foreign/records.py),
                       from which scripts/foreign-report.sh renders reports/foreign/llamacpp.md
    llamacpp_record    llamacpp_record(kind, **fields): append one record of that kind there
    llamacpp_label     llamacpp_label(url) -> the server kind (or proxy name) behind a base URL

Environment: SPECBENCH_LLAMACPP=0 skips all of them; SPECBENCH_LLAMACPP=cached skips unless the build is
already cached (no 10-minute build); SPECBENCH_LLAMACPP_CACHE moves the cache. They skip, with the
reason, only when no C++ toolchain exists (or when told to); the reason is repeated in the terminal
summary, where `pytest -q` shows it without -rs. A source that cannot be fetched, a build or a conversion
that fails is an error, never a skip or a pass. Every test under tests/foreign gets a 30-minute
timeout, because the first one to ask for a server pays for the build on a cold cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from specbench import env
from specbench.harness.foreign import llamacpp as lc
from specbench.harness.foreign import records

FOREIGN_DIR = Path(__file__).resolve().parent
BUILD_TIMEOUT_S = int(env.get("SPECBENCH_LLAMACPP_TEST_TIMEOUT"))
SERVER_LIFETIME_S = float(env.get("SPECBENCH_LLAMACPP_LIFETIME"))

# what the fixtures cost in this session, printed in the terminal summary
TIMINGS: dict[str, float] = {}
NOTES: list[str] = []
LABELS: dict[str, str] = {}  # base URL -> server kind or proxy name, for the records


def pytest_configure(config):
    config.addinivalue_line("markers", "llamacpp: uses llama.cpp's llama-server (tests/foreign)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if FOREIGN_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.llamacpp)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S))


def _foreign_skips(terminalreporter) -> dict[str, int]:
    """Skip reasons of the tests under tests/foreign, with how many tests each skipped."""
    out: dict[str, int] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        path = Path(str(rep.fspath)).resolve() if getattr(rep, "fspath", None) else None
        if path is None or FOREIGN_DIR not in path.parents:
            continue
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        out[reason] = out.get(reason, 0) + 1
    return out


def pytest_terminal_summary(terminalreporter):
    skips = _foreign_skips(terminalreporter)
    if not TIMINGS and not NOTES and not skips:
        return
    terminalreporter.section("llama.cpp fixtures")
    for reason, n in skips.items():  # visible without -rs: the foreign engine did not run
        terminalreporter.write_line(f"SKIPPED {n} llama.cpp test(s): {reason}", yellow=True, bold=True)
    for k, v in TIMINGS.items():
        terminalreporter.write_line(f"{k}: {v:.2f} s")
    for n in NOTES:
        terminalreporter.write_line(n)


@pytest.fixture(scope="session")
def llamacpp_notes() -> list[str]:
    """Lines for the terminal summary (findings, acceptance rates)."""
    return NOTES


@pytest.fixture(scope="session")
def llamacpp_results(tmp_path_factory) -> Path:
    """Where the session's records go: $SPECBENCH_LLAMACPP_RESULTS, else a temp directory."""
    d = records.results_dir() or tmp_path_factory.mktemp("llamacpp-results")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def llamacpp_record(llamacpp_results):
    def record(record_kind: str, /, **fields) -> dict:
        return records.append(llamacpp_results, record_kind, fields)

    return record


@pytest.fixture(scope="session")
def llamacpp_label():
    def label(url: str, name: str | None = None) -> str:
        """The kind behind a server URL; with `name`, register `url` under it (a proxy) first."""
        url = str(url).rstrip("/")
        if name is not None:
            LABELS[url] = name
        return LABELS.get(url, url)

    return label


def _mode() -> str:
    return str(env.get("SPECBENCH_LLAMACPP"))


@pytest.fixture(scope="session")
def llamacpp_build(llamacpp_record) -> lc.Build:
    mode = _mode()
    if mode == "0":  # 0, off, false or no (specbench/env.py)
        pytest.skip("llama.cpp tests disabled (SPECBENCH_LLAMACPP=0)")
    t0 = time.monotonic()
    cached = lc.cached_build()
    if cached is None:
        if mode == "cached":
            pytest.skip(f"llama.cpp not built at {lc.build_dir()} and SPECBENCH_LLAMACPP=cached "
                        "(build: python -m specbench.harness.foreign.llamacpp build)")
        why = lc.toolchain_missing()
        if why:  # the one case that skips by itself: the machine cannot build C++ at all
            pytest.skip(f"llama.cpp: {why}")
    # A source that cannot be fetched or a build that fails raises Unavailable: an error in every test that
    # needs it (pytest re-raises the cached fixture error), never a skip or a pass.
    try:
        b = cached or lc.ensure_build()
    except lc.Unavailable as e:
        raise lc.Unavailable(f"{e} (SPECBENCH_LLAMACPP_SDIST=<file> uses a local copy of the sdist; "
                             "SPECBENCH_LLAMACPP=0 skips the llama.cpp tests on purpose)") from None
    dt = time.monotonic() - t0
    TIMINGS["llamacpp build (cached)" if cached else "llamacpp build (fresh)"] = dt
    if not cached:
        NOTES.append(f"llama.cpp build: {b.info.get('total_s')} s, see {b.root / 'build.log'}")
    llamacpp_record("build", cached=cached is not None, setup_s=round(dt, 2), dir=str(b.root), pin=lc.PIN,
                    info=b.info)
    return b


@pytest.fixture(scope="session")
def llamacpp_models(llamacpp_build, llamacpp_record) -> lc.Models:
    t0 = time.monotonic()
    m = lc.ensure_models(llamacpp_build)
    TIMINGS["llamacpp GGUF fixtures"] = time.monotonic() - t0
    llamacpp_record("models", setup_s=round(time.monotonic() - t0, 2), dir=str(m.dir), info=m.info,
                    files={k: v.name for k, v in vars(m).items() if isinstance(v, Path) and k != "dir"})
    return m


@pytest.fixture(scope="session")
def llamacpp_log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llamacpp-logs")


def server_command(s: lc.LlamaServer, build: lc.Build, models: lc.Models) -> list[str]:
    """A server's command line with the machine-specific parts as placeholders ($LLAMACPP, $GGUF, $PORT)."""
    subs = {str(models.dir): "$GGUF", str(build.root): "$LLAMACPP"}  # the GGUF dir lies inside the build's
    out = []
    for a in s.args:
        for k, v in subs.items():
            a = a.replace(k, v)
        out.append("$PORT" if a == str(s.port) else a)
    return out


@pytest.fixture(scope="session")
def llamacpp_server(llamacpp_build, llamacpp_models, llamacpp_log_dir, llamacpp_record):
    started: list[lc.LlamaServer] = []

    def start(kind: str, **kw) -> lc.LlamaServer:
        kw.setdefault("lifetime_s", SERVER_LIFETIME_S)
        kw.setdefault("log_dir", llamacpp_log_dir)
        t0 = time.monotonic()
        s = lc.start_server(kind, llamacpp_models, llamacpp_build, **kw)
        dt = time.monotonic() - t0
        TIMINGS[f"llamacpp server {s.name} start"] = dt
        LABELS[s.base_url] = s.name
        llamacpp_record("server", server=kind, name=s.name, start_s=round(dt, 2),
                        command=server_command(s, llamacpp_build, llamacpp_models))
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
