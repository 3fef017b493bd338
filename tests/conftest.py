"""Shared fixtures: the bundled tiny pair (committed under harness/data/fixtures/tiny)."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

from specbench import env

torch.set_num_threads(min(2, os.cpu_count() or 1))
GPU_SKIP = "needs a CUDA GPU (run on the device: scripts/gpu.sh)"
# Every engine a test builds checks its run-time invariants after every step (engine/invariants.py), unless
# the test says otherwise (EngineConfig.check_invariants=False, or the engine string invariants=0).
os.environ.setdefault("SPECBENCH_INVARIANTS", "1")
# A suite started where SIGINT is ignored (a script's `cmd &`: the shell ignores SIGINT for it) would hand that
# disposition to every subprocess a test starts, and the tests that press Ctrl-C on a command would find it
# ignored there (130 expected, the command never stops). Run the tests as a terminal runs them: Python's own
# Ctrl-C handler here, so children start with the default. A test that wants SIGINT ignored in its subprocess
# says so itself (preexec_fn), as test_cli_errors' ignored-SIGINT tests do.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _rss_mib() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) // 1024


RSS_COLLECT_MIB = 3072  # above this after a test, the cycle collector runs (see pytest_runtest_protocol)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """An engine's parts refer to each other, so an engine a test dropped without `close()` (an adapter's aclose
    stops its loop, not its engine) is cyclic garbage holding its weights and KV pool (~0.6 GiB for the tiny pair's
    default pool) until the cycle collector runs, which large tensors do not prompt: one `make test` process grew
    to 13 GiB that way. Above RSS_COLLECT_MIB after a test, collect (a few tests' cost in all, not one per test).
    SPECBENCH_TEST_RSS=FILE: each test's resident memory after it and its growth, to find what holds memory."""
    path = env.get("SPECBENCH_TEST_RSS")
    before = _rss_mib() if path else 0
    yield
    after = _rss_mib()
    if after > RSS_COLLECT_MIB:
        gc.collect()
    if path:
        with open(path, "a") as f:
            f.write(f"{after}\t{after - before}\t{item.nodeid}\n")


def pytest_collection_modifyitems(config, items):
    """A `gpu` test is shown as skipped, with the reason, where no CUDA device is visible: never run on CPU,
    never silently deselected."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_pair():
    pair = env.get("SPECBENCH_TEST_PAIR")  # developer override: "target_dir,draft_dir"
    if pair:
        target, draft = pair.split(",")
        return target, draft
    from specbench.harness.fixtures import bundled_pair

    target, draft = bundled_pair()
    return str(target), str(draft)


@pytest.fixture(scope="session")
def tiny_target(tiny_pair):
    return tiny_pair[0]


@pytest.fixture(scope="session")
def tiny_draft(tiny_pair):
    return tiny_pair[1]


@pytest.fixture(scope="session")
def gsm8k_prompts():
    """A few gsm8k test questions in the fixture's training format."""
    import json
    from importlib import resources

    from specbench.harness.datasets import gsm8k_prompt

    path = resources.files("specbench.harness") / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:16]]
    return [gsm8k_prompt(r["question"][:400]) for r in rows]
