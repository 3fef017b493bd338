#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels and the project, run the GPU tests, run the decode
# benchmark, bring the JIT caches back. Everything is tee'd under $OUT (see docs/gpu.md).
#
# Usage (from the repo root, on the device):  bash scripts/gpu.sh [tests|bench|all] [benchmark args...]
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
