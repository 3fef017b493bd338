"""Shared fixtures: the bundled tiny pair (committed under harness/data/fixtures/tiny)."""

from __future__ import annotations

import os

import pytest
import torch

from specbench import env

torch.set_num_threads(min(2, os.cpu_count() or 1))
GPU_SKIP = "needs a CUDA GPU (run on the device: scripts/gpu.sh)"
# Every engine a test builds checks its run-time invariants after every step (engine/invariants.py), unless
# the test says otherwise (EngineConfig.check_invariants=False, or the engine string invariants=0).
os.environ.setdefault("SPECBENCH_INVARIANTS", "1")


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
