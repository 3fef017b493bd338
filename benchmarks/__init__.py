"""Benchmark scripts as importable modules: `python -m specbench.benchmarks.<name> --help`.

Each prints a table and then one JSON document as its last stdout line (harness/benchdoc.py). Timings live
here, never in asserting tests.
"""
