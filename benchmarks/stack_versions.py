"""The serving stack's versions as one JSON line: torch, transformers, CUDA, the GPU, vLLM, FlashInfer.

Run as a file (`python benchmarks/stack_versions.py`), it imports nothing of specbench, so it reports what an
interpreter with any PYTHONPATH sees (scripts/vllm_suite.py runs it in the vLLM and the bundled servers'
environments). A package that does not import is reported by its error, not raised.
"""

from __future__ import annotations

import json


def stack_versions() -> dict:
    import torch
    import transformers

    d = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
         "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name in ("vllm", "flashinfer"):
        try:
            d[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - a broken install is a finding to report, not a crash
            d[name] = repr(e)
    return d


if __name__ == "__main__":
    print(json.dumps(stack_versions()))
