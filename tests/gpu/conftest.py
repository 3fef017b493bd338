"""GPU tests: collected by every run and, where no CUDA device is visible, skipped with the reason
(tests/conftest.py marks every `gpu` test, wherever it lives); on the device `pytest -m gpu` runs only
them. Helpers in tests/ (qwen3_random, kernel_cases) are importable."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
