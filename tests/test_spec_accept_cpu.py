"""The fused speculative-sampling accept kernel (kernels/spec_accept.py) against the torch path of
`accept_sampled_batch`, under the Triton interpreter (a subprocess: TRITON_INTERPRET must be set before
triton is imported). Same generators on both sides, so the same uniforms: the accepted counts must be
equal, the emitted tokens equal but for rare fp32 ties of the cumulative sums, and always of positive
probability under the distribution they are drawn from. The GPU twin is tests/gpu/test_kernels.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from interp import PRELUDE

from specbench.kernels import triton_importable

SCRIPT = PRELUDE + textwrap.dedent('''

    sys.path.insert(0, sys.argv[1])
    from spec_accept_cases import run_cases
    print(run_cases(torch.device("cpu"), vocabs=(7, 300, 5000), trials=3))
    import specbench.kernels.spec_accept as sa
    sa.ROWS = 2  # several tiles in the chunk-sums loop, the last one partly masked
    print(run_cases(torch.device("cpu"), vocabs=(5000,), trials=2))
    print("SPEC ACCEPT OK")
''')


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed: the interpreter checks need it")
def test_spec_accept_kernel_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(Path(__file__).parent)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "SPEC ACCEPT OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_torch_path_without_interpreter():
    """Without the interpreter (and no CUDA) the engine keeps the torch path; the switch is honoured."""
    import torch

    from specbench.engine.spec import sampling

    p = torch.softmax(torch.randn(3, 11), -1)
    gen = [torch.Generator().manual_seed(0)]
    a = sampling.accept_sampled_batch([[1, 2]], [None], p, gen)
    sampling.USE_KERNEL = False
    try:
        gen = [torch.Generator().manual_seed(0)]
        assert sampling.accept_sampled_batch([[1, 2]], [None], p, gen) == a
    finally:
        sampling.USE_KERNEL = True
