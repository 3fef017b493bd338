#!/usr/bin/env bash
# reports/foreign/llamacpp.md, regenerated from a CI-equivalent run (issue #27):
#
#   scripts/foreign-report.sh [OUT_DIR]          # default reports/foreign
#
# 1. the llama.cpp tests of `make test` (pytest tests/foreign: build or cache, GGUF fixtures, the servers,
#    every gate, the sampled gate, the sweep c1,4 with its report and --audit, the findings), with their
#    records kept in OUT_DIR/llamacpp-runs/ (SPECBENCH_LLAMACPP_RESULTS: the gates' results runs,
#    foreign.jsonl, junit.xml);
# 2. the report rendered from those records alone (python -m specbench.suites.report.foreign).
#
# Exit 0 only when every test passed, every scenario exited as expected and every finding reproduced;
# otherwise 1 (the report is still written, with what went wrong at the top). A run in which llama.cpp
# did not run at all (no toolchain, SPECBENCH_LLAMACPP=0) writes no report and exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-reports/foreign}
runs="$out/llamacpp-runs"
make -s setup
# The run writes into a scratch folder and replaces $runs only at the end, so the tree the tests record
# (git sha, dirty or not) is the one the run started from, not one its own output has dirtied.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
SPECBENCH_LLAMACPP_RESULTS="$scratch" .venv/bin/pytest -q -p no:cacheprovider tests/foreign \
    --junitxml="$scratch/junit.xml"
rc=$?
rm -rf "$runs"
mkdir -p "$(dirname "$runs")"
cp -r "$scratch" "$runs"
.venv/bin/python -m specbench.suites.report.foreign "$runs" --pytest-exit "$rc" --out "$out/llamacpp.md"
