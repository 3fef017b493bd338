#!/usr/bin/env bash
# The nightly GPU job (.github/workflows/nightly-gpu.yml calls it; runs by hand the same way).
#
#   scripts/nightly.sh [OUT]        # OUT defaults to ./nightly-out
#
# 1. locate (or build) the random Qwen3-4B-shaped pair: $SPECBENCH_MODELS/{target,draft}, built with
#    `specbench fixtures --shape qwen3-4b --device cuda` when missing (about 9 GB, reused afterwards);
# 2. lossless gates, each its own command and exit code:
#    - the bundled tiny pair on the GPU in fp32, spec off vs DFlash (its trained drafter gives real
#      acceptance), with the concurrent heterogeneous gate and the engine gates (exact match expected);
#    - the same in bf16, where the regret gate judges tie flips;
#    (not the 4B-shaped pair: its random drafter accepts nothing and random greedy text seldom repeats,
#    so DFlash and n-gram there are both NOT SPECULATING, seen on an H200 2026-11-29);
# 3. a sweep on the 4B-shaped pair: spec off vs DFlash with synthetic acceptance (tau=$NIGHTLY_TAU,
#    labelled synthetic in every record and report), interleaved rounds, paired noise floor;
# 4. the reports (markdown + PNG) under OUT/report, the markdown appended to $GITHUB_STEP_SUMMARY;
#    result records under OUT/results for the artifact upload;
# 5. on CUDA, the fast-path benchmarks at small size (benchmarks/decode.py --quick on the 4B-shaped target:
#    FlashInfer tensor-core vs split-K Triton decode vs the engine default (split-K + GEMVs) against the dense
#    floor; benchmarks/accept_cost.py: the greedy and
#    sampled accept steps), their tables in the summary (NIGHTLY_SKIP_BENCH=1 skips them).
# Exit status: 1 when any gate fails or the sweep fails, after everything has run and been written.
#
# Knobs (environment): SPECBENCH (the CLI, default .venv/bin/specbench or specbench on PATH),
# SPECBENCH_MODELS, NIGHTLY_DEVICE (cuda), NIGHTLY_CONCURRENCY (1,8,16,32,64), NIGHTLY_ROUNDS (3),
# NIGHTLY_PROMPTS_PER_LEVEL (4), NIGHTLY_MAX_TOKENS (128), NIGHTLY_DATASET (sharegpt), NIGHTLY_TAU (3.5),
# NIGHTLY_NUM_PAGES (4096 KV pages per engine), NIGHTLY_GATE_PROMPTS (8), NIGHTLY_GATE_TOKENS (128),
# NIGHTLY_SWEEP_TIMEOUT (seconds; on expiry the sweep is interrupted like Ctrl-C: its records are kept,
# the run is marked incomplete, the report says so and the step fails), NIGHTLY_SKIP_GATES=1 (sweep only).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${1:-nightly-out}" && cd "${1:-nightly-out}" && pwd)
if [[ -n "${SPECBENCH:-}" ]]; then read -r -a SB <<< "$SPECBENCH"   # e.g. "python3 -m specbench"
elif [[ -x .venv/bin/specbench ]]; then SB=("$PWD/.venv/bin/specbench")
else SB=(specbench); fi
MODELS=${SPECBENCH_MODELS:-$HOME/.cache/specbench/qwen3-4b-shape}
DEVICE=${NIGHTLY_DEVICE:-cuda}
CONC=${NIGHTLY_CONCURRENCY:-1,8,16,32,64}
ROUNDS=${NIGHTLY_ROUNDS:-3}
PPL=${NIGHTLY_PROMPTS_PER_LEVEL:-4}
MAXTOK=${NIGHTLY_MAX_TOKENS:-128}
DATASET=${NIGHTLY_DATASET:-sharegpt}
TAU=${NIGHTLY_TAU:-3.5}
RESULTS=$OUT/results
REPORTS=$OUT/report
mkdir -p "$RESULTS" "$REPORTS"
export SPECBENCH_RESULTS=$RESULTS
STATUS=()
FAILED=0

log() { printf '\n[nightly %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
step() {  # step NAME CMD...: run, record the exit code, never stop the job
  local name=$1; shift
  log "$name: $*"
  local t0=$SECONDS
  "$@"
  local rc=$?
  STATUS+=("| $name | $rc | $((SECONDS - t0)) s |")
  if [[ $rc -ne 0 ]]; then FAILED=1; log "$name FAILED (exit $rc)"; fi
  return $rc
}

log "specbench: $("${SB[@]}" --version 2>&1)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 1. models
if [[ -f $MODELS/target/config.json && -f $MODELS/draft/config.json ]]; then
  log "using the Qwen3-4B-shaped pair in $MODELS"
else
  step "build qwen3-4b-shaped pair" "${SB[@]}" fixtures --shape qwen3-4b --out "$MODELS" --device "$DEVICE" || {
    log "no models: stopping"; exit 1; }
fi
T=$MODELS/target
D=$MODELS/draft
# Explicit KV pools: several engines share one GPU in one process (each would otherwise size itself
# to most of the free memory).
PAGES=${NIGHTLY_NUM_PAGES:-4096}
GPU="device=$DEVICE,num_pages=$PAGES"
BIG="device=$DEVICE,dtype=bfloat16,num_pages=$PAGES"
GP=${NIGHTLY_GATE_PROMPTS:-8}
GT=${NIGHTLY_GATE_TOKENS:-128}

# 2. lossless gates
if [[ "${NIGHTLY_SKIP_GATES:-0}" != 1 ]]; then
  step "lossless: tiny pair, dflash, $DEVICE" "${SB[@]}" lossless \
    --baseline "local,spec=off,$GPU" --candidate "local,spec=dflash,$GPU" \
    --num-prompts $((2 * GP)) --max-tokens "$GT" --concurrency 4 --concurrent --engine-gates \
    --report "$REPORTS/lossless-tiny.md"
  step "lossless: tiny pair, dflash, $DEVICE bf16" "${SB[@]}" lossless --margin-tol 0.20 \
    --baseline "local,spec=off,$GPU,dtype=bfloat16" --candidate "local,spec=dflash,$GPU,dtype=bfloat16" \
    --num-prompts $((2 * GP)) --max-tokens "$GT" --concurrency 4 --concurrent \
    --report "$REPORTS/lossless-tiny-bf16.md"
fi

# 3. sweep (+ 4. its report)
LIMIT=()
[[ -n "${NIGHTLY_SWEEP_TIMEOUT:-}" ]] && LIMIT=(timeout -s INT -k 60 "$NIGHTLY_SWEEP_TIMEOUT")
step "sweep: qwen3-4b shape, off vs dflash tau=$TAU" "${LIMIT[@]}" "${SB[@]}" sweep --concurrency "$CONC" \
  --arms "local:$T,spec=off,$BIG,name=spec-off,local:$T,draft=$D,$BIG,tau=$TAU,name=dflash-tau$TAU" \
  --dataset "$DATASET" --prompts-per-level "$PPL" --max-tokens "$MAXTOK" --ignore-eos \
  --rounds "$ROUNDS" --warmup 2 --no-progress --report "$REPORTS/sweep.md"

# 5. fast-path benchmarks (tables in the summary; JSON under OUT/report)
if [[ "$DEVICE" == cuda* && "${NIGHTLY_SKIP_BENCH:-0}" != 1 ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
  bench() {  # bench NAME OUTFILE CMD...: the table (stdout less its JSON last line) to OUTFILE.txt
    local name=$1 out=$2; shift 2
    step "$name" bash -c '"$@" > "$0.log" 2>&1; rc=$?; grep -v "^{" "$0.log" | grep -E "^[|#A-Za-z0-9 -]" > "$0.txt"; tail -n 1 "$0.log" > "$0.json"; exit $rc' "$out" "$@"
  }
  bench "bench: decode (quick)" "$REPORTS/decode" "$PY" -m specbench.benchmarks.decode --model "$T" --quick --no-hf \
    --variants fi-tc-graph,fi-tritondecode-graph,fi-graph
  bench "bench: accept step" "$REPORTS/accept" "$PY" -m specbench.benchmarks.accept_cost --device cuda --batches 1,64
fi

# job summary: the verdicts, then every markdown report (plots are in the artifact)
{
  echo "# specbench nightly ($(date -u +%Y-%m-%dT%H:%MZ), $(git rev-parse --short HEAD 2>/dev/null))"
  echo
  echo "| step | exit | time |"
  echo "|---|---:|---:|"
  printf '%s\n' "${STATUS[@]}"
  echo
  for f in "$REPORTS"/lossless-*.md "$REPORTS"/sweep.md; do
    [[ -f $f ]] || continue
    echo "<details><summary>$(basename "$f")</summary>"
    echo
    sed 's/!\[\([^]]*\)\]([^)]*)/(plot: \1, see the artifact)/' "$f"
    echo
    echo "</details>"
  done
  for f in "$REPORTS"/decode.txt "$REPORTS"/accept.txt; do
    [[ -s $f ]] || continue
    echo "<details><summary>$(basename "$f" .txt) benchmark</summary>"
    echo
    echo '```'
    cat "$f"
    echo '```'
    echo
    echo "</details>"
  done
} > "$OUT/summary.md"
if [[ -n "${GITHUB_STEP_SUMMARY:-}" ]]; then cat "$OUT/summary.md" >> "$GITHUB_STEP_SUMMARY"; fi
log "summary: $OUT/summary.md; reports: $REPORTS; records: $RESULTS"
printf '%s\n' "${STATUS[@]}"
exit $FAILED
