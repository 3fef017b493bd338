"""What `make test` / CI show: GPU tests are skipped with their reason on CPU (never run, never silently
deselected), and in CI the Triton interpreter tests cannot skip quietly (triton is in the test extra)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the GPU tests run")
def test_gpu_tests_are_skipped_with_the_reason_on_cpu() -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu/test_kernels.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-2000:]
    assert "deselected" not in text and " passed" not in text and " failed" not in text, text[-2000:]
    assert "skipped" in text and "SKIPPED" in text and "needs a CUDA GPU" in text, text[-2000:]


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="checks CI's environment (CI=true)")
def test_ci_runs_the_triton_interpreter_tests() -> None:
    from specbench.kernels import triton_importable

    assert triton_importable(), "triton is not importable in CI: the interpreter tests would skip (test extra)"
