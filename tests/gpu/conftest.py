"""GPU tests: collected by every run and, where no CUDA device is visible, skipped with the reason
(tests/conftest.py marks every `gpu` test, wherever it lives); on the device `pytest -m gpu` runs only
them. Helpers in tests/ (qwen3_random, kernel_cases) are importable. Fixtures shared by the GPU tests:
`tiny` (the bundled pair as (target, draft) paths, skipping where it is not built)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(scope="module")
def tiny():
    """The bundled tiny pair as (target dir, draft dir); skips where the fixture is not built."""
    from specbench.harness.fixtures import bundled_pair

    target, draft = bundled_pair()
    if not (target / "model.safetensors").is_file():
        pytest.skip(f"bundled tiny fixture not built at {target}")
    return str(target), str(draft)
