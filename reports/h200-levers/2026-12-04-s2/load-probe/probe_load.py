"""One-off: the engine under closed-loop load at c16/c64, gate 1 vs the automatic policy vs fixed span, per tau,
with per-step records (benchmarks/load.py --steps-out)."""
import json
import os
import shutil
import sys
from pathlib import Path

from specbench.benchmarks import load

W = Path(os.environ.get("W", "/tmp/specbench-work"))
OUT = Path(os.environ.get("OUT", "/tmp/specbench-out"))
arms = [{"name": "gate1", "kw": {"spec_gate": 1}}, {"name": "auto", "kw": {"spec_policy": "auto"}},
        {"name": "fixed", "kw": {}}]
for tau in sys.argv[1:] or ["3.5", "6.5"]:
    d = W / f"probe-tau{tau}"
    try:
        load.main(["--workdir", "/tmp/q3-4b-pair", "--levels", "16,64", "--repeats", "2", "--waves", "3",
                   "--prompt-min", "40", "--prompt-max", "110", "--max-tokens", "128", "--tau", tau,
                   "--num-pages", "3000", "--arms", json.dumps(arms), "--out-dir", str(d), "--steps-out"])
    except BaseException as e:  # keep what was measured
        print("probe tau", tau, "failed:", repr(e), flush=True)
    if d.exists():
        shutil.copytree(d, OUT / d.name, dirs_exist_ok=True)
