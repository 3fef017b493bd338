"""GPU tests: collected only with `-m gpu` (pyproject deselects them by default) and skipped, with a
reason, where no CUDA device is visible. Helpers in tests/ (qwen3_random, kernel_cases) are importable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device: scripts/gpu.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
