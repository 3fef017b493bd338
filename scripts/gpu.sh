#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels and the project, run the GPU tests, run the decode
# benchmark, bring the JIT caches back. Everything is tee'd under $OUT (see docs/gpu.md).
#
# Usage (from the repo root, on the device):  bash scripts/gpu.sh "MODE [MODE...]" [benchmark args...]
# Several modes run in one call, in the order given; DEADLINE (seconds, default 570) caps the whole call: each
# step's timeout is cut to what is left, and results are packed into $OUT/results.tgz after every step, so a
# call stopped at its limit still brings back what finished.
#   tests        pytest -m gpu ${TEST_PATHS:-tests/gpu}          bench       benchmarks/decode.py
#   all          tests, then bench
#   spec-tests   pytest -m gpu tests/gpu/test_spec_gpu.py (issue 8: regret gate, graph == eager, OOM)
#   spec-steps   benchmarks/spec_step.py --part steps (per-step draft/verify/decode times, ideal speedups)
#   spec-sweep   benchmarks/spec_step.py --part sweep (spec off vs synthetic tau 2/3.5/5/6.5 at c1..c64),
#                with STEPS_JSON (default /tmp/spec_steps.json, written by spec-steps) for the ideal column
#   spec         spec-steps, then spec-sweep (one call: give SWEEP_TIMEOUT room; see docs/gpu.md)
#   lossless     specbench lossless --margin-tol 0.20 spec off vs DFlash on the Qwen3-4B-shaped pair
#   sampled      specbench sampled (spec off vs DFlash, with the null arm) on the bundled pair on CUDA
#   gemv         benchmarks/gemv.py (Triton GEMVs vs cuBLAS per decode shape, config search; GEMV_ARGS)
#   accept       benchmarks/accept_cost.py at batch 1 and 64 (issue 11: sampling vs greedy accept step)
#   profile      specbench profile on the pair: spec off/on (synthetic tau 6.5) x eager/graphs (issue 9)
#   levers       scripts/levers.sh on the pair (issue 20): per synthetic tau (LEVERS_TAUS, default "6.5 3.5 2.0";
#                one tau per call fits the deadline) one `specbench tune --each` sweep of plain, spec without levers,
#                trim 4 / 2, gate 16 and the automatic policy at c1..c64, merged into $OUT/h200-levers/levers.{json,md}
#                (and into reports/h200-levers/levers.json when the tree carries one); LEVERS_* knobs: scripts/levers.sh
#   gated-ab     issue 20: one `specbench tune --arms` sweep per GATED_TAUS (2.0) of plain, the automatic policy and gate 1,
#                each with gated rounds one step ahead (EngineConfig.gated_ahead) on and off, c GATED_LEVELS (1,16,64),
#                interleaved rounds with the paired noise floor; $OUT/h200-gated/gated.{json,md} (GATED_* knobs)
#   speed        benchmarks/speed.py (issue 19): plain decode per step vs the dense floor by concurrency, step
#                benches b1, spec vs plain at synthetic tau 6.5, decode step vs context; writes $W/h200-engine/
#                speed.json + speed.md (copied to $OUT/h200-engine/); SPEED_ARGS adds benchmark flags
#   load         benchmarks/load.py (issues 19, 28): the engine in process under closed-loop load (a finished request
#                replaced at once), arms interleaved (default: the padded runner's row ladder vs bucket x span), time per
#                forward path; $W/h200-load/load.{json,md}, copied to $OUT/h200-load/; LOAD_ARGS adds flags
#   serve-capacity  benchmarks/serve_capacity.py (issue 28): `specbench serve`'s app in process and with the engine
#                process against a paced engine (the tiny target's output path, each step a CUDA-free sleep), c16/c64;
#                what the serving stack streams when the engine is not the limit; CAPACITY_ARGS adds flags; needs the
#                server stack (carry .whl-eval); $OUT/h200-serve-capacity/
#   bisect       benchmarks/speed.py --sections steps on this tree ("head") and on every carried .bisect/<commit>.tgz
#                (a `git archive` of the code folders; this tree's speed.py is used for each), one machine
#   serve-ab     issue 28 item 4: `specbench serve` servers (Qwen3-4B-shaped pair, spec off), one per arm of SERVE_AB_ARMS
#                ("label:port:VAR=v,VAR=v ..."; default: GIL switch 5 ms + per-delta hand-over vs the defaults), one
#                interleaved `specbench sweep` over them (SERVE_AB_LEVELS, _DATASET, _PPL, _ROUNDS); $OUT/h200-serve/
#   attrib       specbench profile with graphs, spec off/on (synthetic tau 6.5) at batch 1 and ATTRIB_BATCH (32):
#                kernel classes, launch gaps and phases per case in $W/attrib-{off,on}-b{1,32}/ (issue 19)
#   eval         specbench eval gsm8k --limit EVAL_LIMIT (50) spec off vs on on the pair (issue 10; needs the
#                server and lm-eval wheels in .whl-eval/, see docs/gpu.md)
#   vllm         vllm-gates, then vllm-speed (issue 28, docs/vllm.md; needs vLLM importable: VLLM_SITE, default
#                /tmp/site-vllm from ../shared/device/vllm/stage.sh, and with no .whl/ the staged /tmp/site-sb)
#   vllm-gates   scripts/vllm_suite.py --part gates: vLLM spec off vs DFlash on the tiny pairs (lossless, concurrent,
#                engine gates, sampled), vs its n-gram proposer on the 4B-shaped pair, prefix-cache triage
#   vllm-speed   scripts/vllm_suite.py --part speed: one sweep, vLLM and `specbench serve` (off, n-gram) side by side
#                (VLLM_SWEEP_LEVELS, VLLM_SWEEP_ROUNDS, VLLM_SWEEP_PPL, VLLM_SWEEP_TOKENS, VLLM_SWEEP_DATASET);
#                servers outlive a call (own sessions) for the next; VLLM_STOP=1 stops them at the end
#   vllm-client  scripts/vllm_suite.py --part client: `vllm bench serve` and `specbench sweep` on one vLLM server,
#                same workload, interleaved rounds, compared with noise floors (client-compare.{json,md})
#   serve-ready  scripts/serve_ready.py: `specbench serve` on the Qwen3-4B-shaped pair (spec off), time to the first
#                HTTP answer, to /health 200 (ready: warm-up done) and the first completion, three times: "carried"
#                (the restored .cache modules and Triton cache), "cold" (no carried FlashInfer modules, empty JIT and
#                Triton dirs), "rerun" (the cold run's own dirs again: a persistent ~/.cache); SERVE_READY_ARGS
#                adds serve flags, SERVE_READY_WARM_S / SERVE_READY_COLD_S cap the runs (90 / 240 s). Needs the
#                server stack (fastapi, uvicorn, pydantic): carry .whl-eval (scripts/fetch-eval-wheels.sh) JSON lines in $W/serve_ready.jsonl and $OUT/serve_ready.jsonl
#   dflash2      benchmarks/dflash2_step.py (issue 25): the DFlash2 draft step vs DFlash1 (graph and eager) at batch 1 on the
#                Qwen3-4B-shaped pair, the random DFlash2 drafter built in $SPEC_WORKDIR/draft-dflash2 when absent;
#                $W/dflash2_step.{json,log}, copied to $OUT/h200-dflash2/; DFLASH2_ARGS adds flags (--batch, --context)
#   prefix       issue 21: the prefix gate on the bundled pair on CUDA (bf16), then benchmarks/prefix.py (a multi-turn
#                workload behind a PREFIX_TOKENS (1000) shared prefix, prefix cache on vs off): the bundled pair
#                (its real drafter: acceptance on warm turns vs cold) and the Qwen3-4B-shaped pair at synthetic tau
#                PREFIX_TAU (6.5: speed); $W/h200-prefix/*, copied to $OUT/h200-prefix/ (reports/h200-prefix/)
#   noise        issue 50: `specbench lossless --suite noise` on the bundled pair on CUDA bf16 at emulated TP NOISE_TP (2)
#                against TP 1: the clean engine, then each of NOISE_FAULTS (accept_tolerance kv_offset verify_pos_shift)
#                under the same noise (each must FAIL); NOISE_PROMPTS (64) x NOISE_TOKENS (128); $OUT/h200-noise/
#                noise-<arm>.{json,md,log} and the run records (docs/noise.md)
#   script       python3 $PROBE after the setup (a one-off probe: PROBE="scratch/x.py args"; carry its folder)
# Knobs: TEST_TIMEOUT, BENCH_TIMEOUT, BENCH_BUDGET (decode); SPEC_TIMEOUT, SPEC_BUDGET (steps), SWEEP_TIMEOUT
# (the sweep is interrupted like Ctrl-C at it: records kept), SWEEP_LEVELS, SWEEP_TAUS, SWEEP_ROUNDS, SWEEP_PPL,
# SWEEP_MAX_TOKENS, SPEC_WORKDIR (the Qwen3-4B-shaped pair; built there when absent).
# Needs: .whl/ with flashinfer-python 0.5.3, apache-tvm-ffi, nvidia-cudnn-frontend (../shared/device/README.md).
# Optional carried caches: .cache/fi_so.tgz (FlashInfer JIT modules, loaded as AOT), .cache/triton.tgz.
set -uo pipefail
modes=${1:-all}
shift || true
OUT=${OUT:-/tmp/specbench-out}
W=${W:-/tmp/specbench-work}  # everything but the caches and gpu.log lands here, then in $OUT/results.tgz
mkdir -p "$OUT" "$W"
start=$(date +%s)
left() { echo $(( ${DEADLINE:-570} - ($(date +%s) - start) )); }
cap() { local l; l=$(( $(left) - 25 )); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 10 ? l : 10 )); }
pack() { tar czf "$OUT/results.tgz.part" --exclude='trace.json' --exclude='*.safetensors' -C "$W" . 2>/dev/null \
  && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi-base TRITON_CACHE_DIR=/tmp/triton-cache
log() { echo "[gpu.sh $(date +%H:%M:%S)] $*" | tee -a "$OUT/gpu.log"; }

if ! ls .whl/*.whl >/dev/null 2>&1 && [ -d "${SB_SITE:-/tmp/site-sb}" ]; then  # vLLM stage: FlashInfer 0.5.3 in site-sb
  log "no .whl/: the bundled engine uses the staged ${SB_SITE:-/tmp/site-sb} (+ ${VLLM_SITE:-/tmp/site-vllm} for its server deps)"
  export PYTHONPATH=${SB_SITE:-/tmp/site-sb}:${VLLM_SITE:-/tmp/site-vllm}${PYTHONPATH:+:$PYTHONPATH}
else
log "install wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl-eval/*.whl 2>/dev/null) \
  || { log "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2 || { log "project install failed"; exit 1; }
if [ -f .cache/fi_so.tgz ]; then  # compiled FlashInfer modules from an earlier call: FlashInfer loads AOT ones as-is
  mkdir -p /tmp/fi-so && tar xzf .cache/fi_so.tgz -C /tmp/fi-so
  for so in $(find /tmp/fi-so -name '*.so'); do
    d=/tmp/site; [ -d /tmp/site/flashinfer ] || d=${SB_SITE:-/tmp/site-sb}  # the vLLM stage's site-sb
    n=$(basename "$so" .so); mkdir -p "$d/flashinfer/data/aot/$n"; cp "$so" "$d/flashinfer/data/aot/$n/$n.so"
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
pair() {  # the Qwen3-4B-shaped random pair (target + b16-shaped drafter), built once per machine
  [ -f "$1/target/config.json" ] && [ -f "$1/draft/config.json" ] && return
  log "building the Qwen3-4B-shaped pair in $1"
  python3 -m specbench fixtures --shape qwen3-4b --out "$1" --device cuda 2>&1 | tail -3 | tee -a "$OUT/gpu.log"
}
for what in $modes; do
[ "$(left)" -lt 40 ] && { log "deadline: skipping $what"; continue; }
if [ "$what" = spec-tests ]; then
  log "pytest -m gpu tests/gpu/test_spec_gpu.py"
  timeout $(cap ${TEST_TIMEOUT:-480}) python3 -m pytest -m gpu tests/gpu/test_spec_gpu.py -q -rA -s -p no:cacheprovider 2>&1 \
    | tee "$W/pytest-spec.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
  log "pytest rc=$r"
fi
if [ "$what" = spec-steps ] || [ "$what" = spec ]; then
  log "spec step benchmark"
  timeout $(cap ${SPEC_TIMEOUT:-420}) python3 -m specbench.benchmarks.spec_step --part steps --workdir "$SPEC_WORKDIR" \
    --out "$W/spec_steps.json" --budget-s ${SPEC_BUDGET:-300} "$@" 2>&1 | tee "$W/spec_steps.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
  [ -f "$W/spec_steps.json" ] && cp "$W/spec_steps.json" /tmp/spec_steps.json
  log "spec steps rc=$r"
fi
if [ "$what" = spec-sweep ] || [ "$what" = spec ]; then
  steps=${STEPS_JSON:-/tmp/spec_steps.json}
  log "spec sweep (steps from $steps)"
  timeout $(cap $(( ${SWEEP_TIMEOUT:-420} + 150 ))) python3 -m specbench.benchmarks.spec_step --part sweep --workdir "$SPEC_WORKDIR" \
    $( [ -f "$steps" ] && echo --steps-json "$steps" ) --levels ${SWEEP_LEVELS:-1,8,16,32,64} --taus ${SWEEP_TAUS:-2,3.5,5,6.5} \
    --rounds ${SWEEP_ROUNDS:-2} --prompts-per-level ${SWEEP_PPL:-4} --max-tokens ${SWEEP_MAX_TOKENS:-128} \
    --sweep-timeout-s $(cap ${SWEEP_TIMEOUT:-420}) --sweep-out "$W/results" --report "$W/spec_sweep.md" \
    --out "$W/spec_sweep.json" "$@" 2>&1 | tee "$W/spec_sweep.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
  log "spec sweep rc=$r"
fi
if [ "$what" = prefix ]; then  # issue 21 -> $OUT/h200-prefix/
  mkdir -p "$W/h200-prefix" "$OUT/h200-prefix"
  log "prefix gate, bundled pair, cuda bf16"
  timeout $(cap ${PREFIX_GATE_TIMEOUT:-150}) python3 -m specbench lossless --suite prefix --num-prompts ${PREFIX_CONVS:-4} \
    --candidate "local,spec=dflash,device=cuda,dtype=bfloat16,attention=torch" --report "$W/h200-prefix/gate-tiny-bf16.md" 2>&1 \
    | tee "$W/h200-prefix/gate.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "prefix gate rc=$r"
  log "prefix benchmark, bundled pair (real drafter), cuda bf16"
  timeout $(cap ${PREFIX_TIMEOUT:-150}) python3 -m specbench.benchmarks.prefix --device cuda --dtype bfloat16 --attention torch \
    --prefix-tokens ${PREFIX_TOKENS:-1000} --conversations ${PREFIX_CONVS_BENCH:-16} --turns ${PREFIX_TURNS:-3} \
    --max-tokens ${PREFIX_MAX_TOKENS:-64} --rounds ${PREFIX_ROUNDS:-3} --out "$W/h200-prefix/prefix-tiny.json" \
    --report "$W/h200-prefix/prefix-tiny.md" 2>&1 | tail -12 | tee "$W/h200-prefix/prefix-tiny.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "prefix benchmark (tiny) rc=$r"
  pair "$SPEC_WORKDIR"
  log "prefix benchmark, Qwen3-4B-shaped pair, synthetic tau ${PREFIX_TAU:-6.5}"
  timeout $(cap ${PREFIX_TIMEOUT:-240}) python3 -m specbench.benchmarks.prefix --target "$SPEC_WORKDIR/target" \
    --draft "$SPEC_WORKDIR/draft" --device cuda --dtype bfloat16 --tau ${PREFIX_TAU:-6.5} \
    --prefix-tokens ${PREFIX_TOKENS:-1000} --conversations ${PREFIX_CONVS_BENCH:-16} --turns ${PREFIX_TURNS:-3} \
    --max-tokens ${PREFIX_MAX_TOKENS:-64} --rounds ${PREFIX_ROUNDS:-3} --out "$W/h200-prefix/prefix-4b.json" \
    --report "$W/h200-prefix/prefix-4b.md" 2>&1 | tail -12 | tee "$W/h200-prefix/prefix-4b.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "prefix benchmark (4b) rc=$r"
  cp "$W"/h200-prefix/* "$OUT/h200-prefix/" 2>/dev/null
fi
if [ "$what" = noise ]; then  # issue 50 -> $OUT/h200-noise/
  mkdir -p "$W/h200-noise" "$OUT/h200-noise"
  for arm in clean ${NOISE_FAULTS:-accept_tolerance kv_offset verify_pos_shift}; do
    [ "$(left)" -lt 60 ] && { log "deadline: skipping noise $arm"; continue; }
    c="local,spec=dflash,device=cuda,dtype=bfloat16,attention=torch,tp_emulate=${NOISE_TP:-2}"
    [ "$arm" = clean ] || c="$c,faults=$arm"
    log "noise suite, bundled pair, cuda bf16, emulated TP ${NOISE_TP:-2}: $arm"
    timeout $(cap ${NOISE_TIMEOUT:-240}) python3 -m specbench lossless --suite noise --candidate "$c" \
      --num-prompts ${NOISE_PROMPTS:-64} --max-tokens ${NOISE_TOKENS:-128} --results "$W/h200-noise/results" \
      --report "$W/h200-noise/noise-$arm.md" --json > "$W/h200-noise/noise-$arm.json" 2> "$W/h200-noise/noise-$arm.log"
    r=$?; log "noise $arm rc=$r (clean: 0 expected; a fault: 1)"
    if [ "$arm" = clean ]; then [ "$r" = 0 ] || rc=$r; elif [ "$r" != 1 ]; then rc=${r/#0/1}; fi
  done
  cp -r "$W"/h200-noise/* "$OUT/h200-noise/" 2>/dev/null
fi
if [ "$what" = dflash2 ]; then
  pair "$SPEC_WORKDIR"
  log "dflash2 draft step benchmark"
  timeout $(cap ${DFLASH2_TIMEOUT:-420}) python3 -m specbench.benchmarks.dflash2_step --workdir "$SPEC_WORKDIR" \
    --out "$W/dflash2_step.json" ${DFLASH2_ARGS:-} 2>&1 | tee "$W/dflash2_step.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
  mkdir -p "$OUT/h200-dflash2" && cp "$W"/dflash2_step.* "$OUT/h200-dflash2/" 2>/dev/null
  log "dflash2 rc=$r"
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  log "pytest -m gpu"
  timeout $(cap ${TEST_TIMEOUT:-300}) python3 -m pytest -m gpu ${TEST_PATHS:-tests/gpu} ${TEST_ARGS:-} -q -rA -s -p no:cacheprovider 2>&1 | tee "$W/pytest.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
  log "pytest rc=$r"
fi
if [ "$what" = script ]; then  # a one-off probe: PROBE="path/to/script.py args" after the setup above
  log "script: ${PROBE:-}"
  timeout $(cap 560) python3 ${PROBE:?PROBE=\"script.py args\" is needed} 2>&1 | tee "$W/probe.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r
  log "script rc=$r"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  log "benchmark"
  timeout $(cap ${BENCH_TIMEOUT:-330}) python3 -m specbench.benchmarks.decode --workdir /tmp/q3-4b --out "$W/bench.json" \
    --budget-s ${BENCH_BUDGET:-250} "$@" 2>&1 \
    | tee "$W/bench.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "benchmark rc=$r"
fi
if [ "$what" = gemv ]; then
  log "GEMV kernels vs cuBLAS on the decode shapes"
  timeout $(cap ${GEMV_TIMEOUT:-240}) python3 -m specbench.benchmarks.gemv --out "$W/gemv.json" ${GEMV_ARGS:-} 2>&1 | tee "$W/gemv.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "gemv rc=$r"
fi
if [ "$what" = accept ]; then
  log "accept-step cost (greedy vs sampled)"
  timeout $(cap ${ACCEPT_TIMEOUT:-120}) python3 -m specbench.benchmarks.accept_cost --device cuda --batches ${ACCEPT_BATCHES:-1,64} ${ACCEPT_ARGS:-} \
    2>&1 | tee "$W/accept_cost.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "accept rc=$r"
fi
if [ "$what" = sampled ]; then
  log "sampled gate on the bundled pair (CUDA)"
  timeout $(cap ${SAMPLED_TIMEOUT:-150}) python3 -m specbench sampled --baseline "local,spec=off,device=cuda" \
    --candidate "local,spec=dflash,device=cuda" --num-prompts ${SAMPLED_PROMPTS:-4} --samples ${SAMPLED_N:-400} \
    --null --no-record --report "$W/sampled-cuda.md" 2>&1 | tee "$W/sampled.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "sampled rc=$r"
fi
if [ "$what" = lossless ]; then
  pair "$SPEC_WORKDIR"
  log "lossless (regret gate) on the Qwen3-4B-shaped pair"
  timeout $(cap ${LOSSLESS_TIMEOUT:-200}) python3 -m specbench lossless --margin-tol 0.20 \
    --baseline "local:$SPEC_WORKDIR/target,spec=off,device=cuda,dtype=bfloat16" \
    --candidate "local:$SPEC_WORKDIR/target,draft=$SPEC_WORKDIR/draft,spec=dflash,device=cuda,dtype=bfloat16" \
    --num-prompts ${LOSSLESS_PROMPTS:-16} --max-tokens ${LOSSLESS_TOKENS:-64} --no-record \
    --report "$W/lossless-4b.md" 2>&1 | tee "$W/lossless.log"
  r=${PIPESTATUS[0]}; log "lossless rc=$r (NOT SPECULATING is expected: a random drafter accepts nothing)"
fi
if [ "$what" = levers ]; then  # issue 20: scripts/levers.sh on the 4B-shaped pair -> $OUT/h200-levers/levers.{json,md}
  pair "$SPEC_WORKDIR"
  mkdir -p "$W/levers" "$OUT/h200-levers"
  # earlier taus' sections (committed under reports/h200-levers) are kept: each call merges into them
  [ -f reports/h200-levers/levers.json ] && [ ! -f "$W/levers/levers.json" ] && cp reports/h200-levers/levers.json "$W/levers/"
  log "levers: taus ${LEVERS_TAUS:-6.5 3.5 2.0} at c ${LEVERS_LEVELS:-1,8,16,32,64}"
  LEVERS_PAIR="$SPEC_WORKDIR" LEVERS_BUDGET=$(( $(left) - 30 )) bash scripts/levers.sh "$W/levers" 2>&1 | tee "$W/levers.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "levers rc=$r"
  cp "$W"/levers/levers.json "$W"/levers/levers.md "$OUT/h200-levers/" 2>/dev/null
fi
if [ "$what" = gated-ab ]; then  # issue 20: gated rounds one step ahead on vs off -> $OUT/h200-gated/
  pair "$SPEC_WORKDIR"
  mkdir -p "$W/gated" "$OUT/h200-gated"
  o=${GATED_OPTS:-device=cuda,dtype=bfloat16,max_model_len=1024}
  for tau in ${GATED_TAUS:-2.0}; do
    b="local:$SPEC_WORKDIR/target,draft=$SPEC_WORKDIR/draft,spec=dflash,$o,tau=$tau"
    log "gated-ab: tau $tau at c ${GATED_LEVELS:-1,16,64}"
    timeout $(cap ${GATED_TIMEOUT:-520}) python3 -m specbench tune -q --concurrency ${GATED_LEVELS:-1,16,64} \
      --arms "plain=local:$SPEC_WORKDIR/target,spec=off,$o;auto=$b,policy=auto;auto-noahead=$b,policy=auto,gated_ahead=0;gate1=$b,gate=1;gate1-noahead=$b,gate=1,gated_ahead=0" \
      --rounds ${GATED_ROUNDS:-2} --prompts-per-level ${GATED_PPL:-4} --max-tokens ${GATED_MAX_TOKENS:-128} \
      --out "$W/gated/results" --json "$W/gated/tau$tau.json" --merge-into "$W/gated/gated.json" \
      --section "synthetic tau $tau: gated_ahead on vs off" 2>&1 | tee "$W/gated/tau$tau.log"
    r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "gated-ab tau $tau rc=$r"
  done
  cp "$W"/gated/gated.json "$W"/gated/gated.md "$W"/gated/*.log "$OUT/h200-gated/" 2>/dev/null
fi
if [ "$what" = profile ]; then
  pair "$SPEC_WORKDIR"
  for sp in off on; do for gm in eager graphs; do
    log "profile spec=$sp $gm"
    timeout $(cap ${PROFILE_TIMEOUT:-150}) python3 -m specbench profile --engine "local:$SPEC_WORKDIR/target,draft=$SPEC_WORKDIR/draft" \
      --spec $sp --$gm --attention flashinfer --device cuda --steps ${PROFILE_STEPS:-20} --batch ${PROFILE_BATCH:-1} \
      $( [ $sp = on ] && echo --synthetic-tau 6.5 ) --out "$W/profile-$sp-$gm" --json 2>&1 | tee "$W/profile-$sp-$gm.log"
    r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "profile spec=$sp $gm rc=$r"
  done; done
fi
if [ "$what" = speed ]; then
  pair "$SPEC_WORKDIR"
  log "speed (benchmarks/speed.py)"
  timeout $(cap ${SPEED_TIMEOUT:-480}) python3 -m specbench.benchmarks.speed --workdir "$SPEC_WORKDIR" \
    --out-dir "$W/h200-engine" ${SPEED_ARGS:-} 2>&1 | tee "$W/speed.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "speed rc=$r"
  mkdir -p "$OUT/h200-engine" && cp "$W"/h200-engine/speed.* "$OUT/h200-engine/" 2>/dev/null
fi
if [ "$what" = load ]; then  # issues 19/28: the engine under closed-loop load, arms interleaved -> $OUT/h200-load/
  case "${LOAD_ARGS:-}" in *'"via"'*)  # an http / http-proc arm serves the engine: it needs the server stack
    python3 -c "import fastapi, uvicorn, pydantic" 2>/dev/null || { log "load: the http arms need fastapi, uvicorn and \
pydantic: carry .whl-eval (scripts/fetch-eval-wheels.sh) or use the vLLM stage's site-sb:site-vllm; skipped"; rc=2; continue; } ;;
  esac
  pair "$SPEC_WORKDIR"
  log "load (benchmarks/load.py)"
  timeout $(cap ${LOAD_TIMEOUT:-420}) python3 -m specbench.benchmarks.load --workdir "$SPEC_WORKDIR" \
    --out-dir "$W/h200-load" ${LOAD_ARGS:-} 2>&1 | tee "$W/load.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "load rc=$r"
  mkdir -p "$OUT/h200-load" && cp "$W"/h200-load/*.{json,md,txt} "$OUT/h200-load/" 2>/dev/null
fi
if [ "$what" = serve-capacity ]; then  # issue 28: the server's streaming ceiling against a paced engine (no GPU used)
  log "serve-capacity (benchmarks/serve_capacity.py)"
  timeout $(cap ${CAPACITY_TIMEOUT:-240}) python3 -m specbench.benchmarks.serve_capacity --out-dir "$W/h200-serve-capacity" \
    ${CAPACITY_ARGS:-} 2>&1 | tail -40 | tee "$W/serve_capacity.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "serve-capacity rc=$r"
  mkdir -p "$OUT/h200-serve-capacity" && cp "$W"/h200-serve-capacity/* "$OUT/h200-serve-capacity/" 2>/dev/null
fi
if [ "$what" = bisect ]; then  # issue 19: `speed --sections steps` on this tree and on each carried .bisect/<commit>.tgz
  pair "$SPEC_WORKDIR"
  mkdir -p "$W/bisect"
  for t in head $(ls .bisect/*.tgz 2>/dev/null); do
    [ "$(left)" -lt 90 ] && { log "deadline: bisect stops before $t"; break; }
    c=$(basename "$t" .tgz); d=.
    if [ "$t" != head ]; then d=/tmp/bis-$c; mkdir -p "$d" && tar xzf "$t" -C "$d" && cp benchmarks/speed.py "$d/benchmarks/"; fi
    log "bisect $c: speed --sections steps"
    (cd "$d" && timeout $(cap ${BISECT_TIMEOUT:-150}) python3 -m specbench.benchmarks.speed --workdir "$SPEC_WORKDIR" \
      --sections steps --repeats ${BISECT_REPEATS:-3} --out-dir "$W/bisect/$c") > "$W/bisect/$c.log" 2>&1
    log "bisect $c rc=$? $(grep -o 'step benches b1.*' "$W/bisect/$c.log" | cut -c1-400)"
  done
fi
if [ "$what" = serve-ab ]; then  # issue 28 item 4: `specbench serve` under load, server settings A/B -> $OUT/h200-serve/
  pair "$SPEC_WORKDIR"
  mkdir -p "$W/h200-serve"
  # arm = label:port:env (env: comma-separated VAR=value for that server); default: the HTTP side as before
  # (GIL switch 5 ms, one hand-over per delta) vs now (0.5 ms, one hand-over per step)
  arms=${SERVE_AB_ARMS:-"before:8201:SPECBENCH_GIL_SWITCH_MS=5,SPECBENCH_BATCH_DELIVERY=0 now:8202:SPECBENCH_GIL_SWITCH_MS=0.5"}
  pids=""; engines=""; labels=""
  for a in $arms; do
    l=${a%%:*}; rest=${a#*:}; p=${rest%%:*}; e=${rest#*:}
    log "serve-ab: starting $l on :$p ($e)"
    env $(echo "$e" | tr ',' ' ') python3 -m specbench serve --model "$SPEC_WORKDIR/target" --device cuda --dtype bfloat16 \
      --spec off --num-pages ${SERVE_AB_PAGES:-5000} --port "$p" --served-model-name q3 --log-level warning \
      > "$W/h200-serve/server-$l.log" 2>&1 &
    pids="$pids $!"; engines="$engines${engines:+,}openai:http://127.0.0.1:$p,model=q3"; labels="$labels${labels:+,}$l"
  done
  set -- $pids
  for a in $arms; do rest=${a#*:}; p=${rest%%:*}; t0=$(date +%s); pid=$1; shift
    until curl -sf "http://127.0.0.1:$p/health" >/dev/null; do sleep 2
      kill -0 "$pid" 2>/dev/null || { log "serve-ab: the server on :$p exited: $(tail -3 "$W"/h200-serve/server-*.log | cut -c1-200)"; break; }
      [ $(( $(date +%s) - t0 )) -gt ${SERVE_AB_READY_S:-240} ] && break; done
    log "serve-ab: :$p ready after $(( $(date +%s) - t0 )) s ($(curl -s http://127.0.0.1:$p/health | cut -c1-160))"
  done
  timeout $(cap ${SERVE_AB_TIMEOUT:-360}) python3 -m specbench sweep --arms "$engines" --labels "$labels" \
    -c ${SERVE_AB_LEVELS:-1,8,32,64} --dataset ${SERVE_AB_DATASET:-spec_bench} --prompts-per-level ${SERVE_AB_PPL:-2} \
    --max-tokens 128 --ignore-eos --rounds ${SERVE_AB_ROUNDS:-2} --no-progress --out "$W/h200-serve/sweep" \
    --report "$W/h200-serve/sweep.md" 2>&1 | tail -40 | tee "$W/h200-serve/sweep.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "serve-ab sweep rc=$r"
  kill $pids 2>/dev/null; sleep 3; kill -9 $pids 2>/dev/null
  find "$W/h200-serve/sweep" -name requests.jsonl -delete 2>/dev/null
  mkdir -p "$OUT/h200-serve" && cp "$W"/h200-serve/*.md "$W"/h200-serve/*.log "$OUT/h200-serve/" 2>/dev/null
fi
if [ "$what" = attrib ]; then
  pair "$SPEC_WORKDIR"
  for b in 1 ${ATTRIB_BATCH:-32}; do for sp in off on; do
    log "attribution: profile spec=$sp graphs batch $b"
    timeout $(cap ${PROFILE_TIMEOUT:-150}) python3 -m specbench profile --engine "local:$SPEC_WORKDIR/target,draft=$SPEC_WORKDIR/draft" \
      --spec $sp --graphs --attention flashinfer --device cuda --steps ${PROFILE_STEPS:-20} --batch $b \
      $( [ $sp = on ] && echo --synthetic-tau 6.5 ) --out "$W/attrib-$sp-b$b" --json 2>&1 | tee "$W/attrib-$sp-b$b.log"
    r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "attrib spec=$sp b$b rc=$r"
  done; done
fi
if [ "$what" = eval ]; then
  pair "$SPEC_WORKDIR"
  log "eval gsm8k --limit ${EVAL_LIMIT:-50}"
  timeout $(cap ${EVAL_TIMEOUT:-480}) python3 -m specbench eval --task gsm8k --limit ${EVAL_LIMIT:-50} \
    --baseline "local:$SPEC_WORKDIR/target,spec=off,device=cuda,dtype=bfloat16" \
    --candidate "local:$SPEC_WORKDIR/target,draft=$SPEC_WORKDIR/draft,spec=dflash,device=cuda,dtype=bfloat16" \
    --concurrency ${EVAL_CONCURRENCY:-8} --results "$W/eval-results" --report "$W/eval-h200.md" 2>&1 | tee "$W/eval.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "eval rc=$r"
fi
if [ "$what" = serve-ready ] && ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  log "serve-ready: skipped: no fastapi/uvicorn (the device image has no server stack): run"
  log "  bash scripts/fetch-eval-wheels.sh here and carry .whl-eval (or use the vLLM stage's site-sb:site-vllm)"
  rc=2
elif [ "$what" = serve-ready ]; then  # issue 28 item 5 (docs/server.md "Ready means ready")
  pair "$SPEC_WORKDIR"
  site=/tmp/site; [ -d /tmp/site/flashinfer ] || site=${SB_SITE:-/tmp/site-sb}
  aot="$site/flashinfer/data/aot"
  sr() {  # label, time limit (s), then env assignments for that run
    local label=$1 lim; lim=$(cap $2); shift 2
    [ "$(left)" -lt 45 ] && { log "serve-ready $label: skipped (deadline)"; return; }
    log "serve-ready $label (limit ${lim}s; $*)"
    env "$@" timeout $lim python3 scripts/serve_ready.py --label "$label" --port 8190 \
      --timeout $(( lim - 15 )) --out "$W/serve_ready.jsonl" --log "$W/serve-$label.log" -- \
      --model "$SPEC_WORKDIR/target" --device cuda --dtype bfloat16 --spec off --num-pages 5000 --max-model-len 4096 \
      --served-model-name q3 ${SERVE_READY_ARGS:-} 2>&1 | tail -1 | cut -c1-600 | tee -a "$OUT/gpu.log"
  }
  sr carried ${SERVE_READY_WARM_S:-90} FLASHINFER_WORKSPACE_BASE="$FLASHINFER_WORKSPACE_BASE" TRITON_CACHE_DIR="$TRITON_CACHE_DIR"
  [ -d "$aot" ] && mv "$aot" "$aot.carried"  # cold: FlashInfer must not find the carried modules
  rm -rf /tmp/sr-cold && mkdir -p /tmp/sr-cold/fi /tmp/sr-cold/triton
  sr cold ${SERVE_READY_COLD_S:-240} FLASHINFER_WORKSPACE_BASE=/tmp/sr-cold/fi TRITON_CACHE_DIR=/tmp/sr-cold/triton
  sr rerun ${SERVE_READY_WARM_S:-90} FLASHINFER_WORKSPACE_BASE=/tmp/sr-cold/fi TRITON_CACHE_DIR=/tmp/sr-cold/triton
  [ -d "$aot.carried" ] && mv "$aot.carried" "$aot"
  mkdir -p "$FLASHINFER_WORKSPACE_BASE" && cp -rn /tmp/sr-cold/fi/. "$FLASHINFER_WORKSPACE_BASE/" 2>/dev/null  # back in fi_so.tgz
  cp "$W/serve_ready.jsonl" "$OUT/" 2>/dev/null
fi
if [ "$what" = vllm ] || [ "$what" = vllm-gates ] || [ "$what" = vllm-speed ] || [ "$what" = vllm-client ]; then  # issue 28
  pair "$SPEC_WORKDIR"
  part=${what#vllm-}; [ "$what" = vllm ] && part=all
  log "vLLM suites (--part $part)"
  SUITE_DEADLINE=$(( $(left) - 30 )) timeout $(cap $(( $(left) - 20 ))) python3 scripts/vllm_suite.py --part $part \
    --out "$W/vllm" $( [ "${VLLM_STOP:-0}" = 1 ] && echo --stop ) 2>&1 | tee "$W/vllm-$part.log"
  r=${PIPESTATUS[0]}; [ "$r" = 0 ] || rc=$r; log "vllm $part rc=$r"
  cp "$W/vllm/summary-$part.json" "$OUT/" 2>/dev/null
fi
pack
done
(cd "$FLASHINFER_WORKSPACE_BASE" 2>/dev/null && find . -name '*.so' | tar czf "$OUT/fi_so.tgz" -T -) 2>/dev/null
[ -d "$TRITON_CACHE_DIR" ] && tar czf "$OUT/triton.tgz" -C "$TRITON_CACHE_DIR" .
ls -la "$OUT" | tee -a "$OUT/gpu.log"
exit $rc
