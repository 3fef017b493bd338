#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels and the project, run the GPU tests, run the decode
# benchmark, bring the JIT caches back. Everything is tee'd under $OUT (see docs/gpu.md).
#
# Usage (from the repo root, on the device):  bash scripts/gpu.sh [MODE] [benchmark args...]
#   tests        pytest -m gpu tests/gpu (all GPU tests)          bench       benchmarks/decode.py
#   all          tests, then bench
#   spec-tests   pytest -m gpu tests/gpu/test_spec_gpu.py (issue 8: regret gate, graph == eager, OOM)
#   spec-steps   benchmarks/spec_step.py --part steps (per-step draft/verify/decode times, ideal speedups)
#   spec-sweep   benchmarks/spec_step.py --part sweep (spec off vs synthetic tau 2/3.5/5/6.5 at c1..c64),
#                with STEPS_JSON (default /tmp/spec_steps.json, written by spec-steps) for the ideal column
#   spec         spec-steps, then spec-sweep (one call: give SWEEP_TIMEOUT room; see docs/gpu.md)
# Knobs: TEST_TIMEOUT, BENCH_TIMEOUT, BENCH_BUDGET (decode); SPEC_TIMEOUT, SPEC_BUDGET (steps), SWEEP_TIMEOUT
# (the sweep is interrupted like Ctrl-C at it: records kept), SWEEP_LEVELS, SWEEP_ROUNDS, SWEEP_PPL,
# SWEEP_MAX_TOKENS, SPEC_WORKDIR (the Qwen3-4B-shaped pair; built there when absent).
# Needs: .whl/ with flashinfer-python 0.5.3, apache-tvm-ffi, nvidia-cudnn-frontend (../shared/device/README.md).
# Optional carried caches: .cache/fi_so.tgz (FlashInfer JIT modules, loaded as AOT), .cache/triton.tgz.
set -uo pipefail
what=${1:-all}
shift || true
OUT=${OUT:-/tmp/specbench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi-base TRITON_CACHE_DIR=/tmp/triton-cache
log() { echo "[gpu.sh $(date +%H:%M:%S)] $*" | tee -a "$OUT/gpu.log"; }

log "install wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { log "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2 || { log "project install failed"; exit 1; }
if [ -f .cache/fi_so.tgz ]; then  # compiled FlashInfer modules from an earlier call: FlashInfer loads AOT ones as-is
  mkdir -p /tmp/fi-so && tar xzf .cache/fi_so.tgz -C /tmp/fi-so
  for so in $(find /tmp/fi-so -name '*.so'); do
    n=$(basename "$so" .so); mkdir -p "/tmp/site/flashinfer/data/aot/$n"; cp "$so" "/tmp/site/flashinfer/data/aot/$n/$n.so"
  done
  log "restored $(find /tmp/fi-so -name '*.so' | wc -l) FlashInfer modules"
fi
[ -f .cache/triton.tgz ] && mkdir -p "$TRITON_CACHE_DIR" && tar xzf .cache/triton.tgz -C "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/gpu.log"
python3 -c "import torch, triton, flashinfer, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'flashinfer', flashinfer.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/gpu.log"
git log --oneline -1 2>/dev/null | tee -a "$OUT/gpu.log"

rc=0
SPEC_WORKDIR=${SPEC_WORKDIR:-/tmp/q3-4b-pair}
if [ "$what" = spec-tests ]; then
  log "pytest -m gpu tests/gpu/test_spec_gpu.py"
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -m gpu tests/gpu/test_spec_gpu.py -q -rA -s -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest-spec.log"
  rc=${PIPESTATUS[0]}
  log "pytest rc=$rc"
fi
if [ "$what" = spec-steps ] || [ "$what" = spec ]; then
  log "spec step benchmark"
  timeout ${SPEC_TIMEOUT:-420} python3 benchmarks/spec_step.py --part steps --workdir "$SPEC_WORKDIR" \
    --out "$OUT/spec_steps.json" --budget-s ${SPEC_BUDGET:-300} "$@" 2>&1 | tee "$OUT/spec_steps.log"
  rc=${PIPESTATUS[0]}
  [ -f "$OUT/spec_steps.json" ] && cp "$OUT/spec_steps.json" /tmp/spec_steps.json
  log "spec steps rc=$rc"
fi
if [ "$what" = spec-sweep ] || [ "$what" = spec ]; then
  steps=${STEPS_JSON:-/tmp/spec_steps.json}
  log "spec sweep (steps from $steps)"
  timeout $(( ${SWEEP_TIMEOUT:-420} + 150 )) python3 benchmarks/spec_step.py --part sweep --workdir "$SPEC_WORKDIR" \
    $( [ -f "$steps" ] && echo --steps-json "$steps" ) --levels ${SWEEP_LEVELS:-1,8,16,32,64} \
    --rounds ${SWEEP_ROUNDS:-2} --prompts-per-level ${SWEEP_PPL:-4} --max-tokens ${SWEEP_MAX_TOKENS:-128} \
    --sweep-timeout-s ${SWEEP_TIMEOUT:-420} --sweep-out "$OUT/results" --report "$OUT/spec_sweep.md" \
    --out "$OUT/spec_sweep.json" "$@" 2>&1 | tee "$OUT/spec_sweep.log"
  rc=${PIPESTATUS[0]}
  log "spec sweep rc=$rc"
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  log "pytest -m gpu"
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu tests/gpu -q -rA -s -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
  log "pytest rc=$rc"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  log "benchmark"
  timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/decode.py --workdir /tmp/q3-4b --out "$OUT/bench.json" \
    --budget-s ${BENCH_BUDGET:-250} "$@" 2>&1 \
    | tee "$OUT/bench.log"
  log "benchmark rc=${PIPESTATUS[0]}"
fi
(cd "$FLASHINFER_WORKSPACE_BASE" 2>/dev/null && find . -name '*.so' | tar czf "$OUT/fi_so.tgz" -T -) 2>/dev/null
[ -d "$TRITON_CACHE_DIR" ] && tar czf "$OUT/triton.tgz" -C "$TRITON_CACHE_DIR" .
ls -la "$OUT" | tee -a "$OUT/gpu.log"
exit $rc
