"""The sampled (T > 0) equivalence gate: stats.py (tests), gate.py (runner), selftest.py, report.py."""
