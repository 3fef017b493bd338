"""specbench: benchmarking and losslessness verification for speculative-decoding engines.

The code lives in four subpackages: `specbench.engine` (the reference engine), `specbench.kernels`
(Triton kernels beside torch references), `specbench.harness` (adapters, results, reports, CLI) and
`specbench.suites` (lossless, sweep, gaps, eval, selftest).
"""

__version__ = "0.1.0"
