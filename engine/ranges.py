"""Named phase ranges (NVTX + torch.profiler.record_function) around the engine's step phases.

Off by default: `NO_RANGES.phase(name)` returns a shared null context, so the cost when profiling is off
is one attribute lookup and a no-op `with`. `ProfilerRanges` opens an NVTX range (the `nvtx` package,
when importable) and a record_function range, which `specbench gaps --phases` reads back from nsys and
PyTorch-profiler traces. Phase names: schedule, draft, verify (a target forward carrying verify spans) or forward (one
without), accept, commit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_NULL = contextlib.nullcontext()


class NoRanges:
    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return _NULL


class ProfilerRanges(NoRanges):
    def __init__(self) -> None:
        try:
            import nvtx

            self._nvtx = nvtx
        except ImportError:  # nvtx is in the gpu extra (no wheel on some platforms): record_function ranges only
            self._nvtx = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        import torch

        with torch.profiler.record_function(name):
            if self._nvtx is not None:
                with self._nvtx.annotate(name, domain="specbench"):
                    yield
            else:
                yield


NO_RANGES = NoRanges()
