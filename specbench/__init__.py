"""specbench: benchmarking and losslessness verification for speculative-decoding engines.

The code lives in six subpackages (each a link to the top-level folder of its name): `specbench.engine` (the
reference engine), `specbench.kernels` (Triton kernels beside torch references), `specbench.harness`
(adapters, the server, fixtures, results, verdicts), `specbench.suites` (lossless, sampled, sweep, gaps, eval
parity, reports, tune), `specbench.benchmarks` (speed scripts) and `specbench.cli` (the commands); the layers
and their import rules are in docs/architecture.md.
"""

__version__ = "0.1.0"
