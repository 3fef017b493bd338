#!/usr/bin/env bash
# Load-aware speculation numbers (issue 20): for each synthetic acceptance length tau, ONE `specbench tune --each`
# sweep (suites/tune.py) of plain decode, speculation without levers, each lever alone (draft trims, the max-batch
# gate) and the automatic span policy, interleaved rounds with the paired noise floor; every tau is merged as a
# section into OUTDIR/levers.json and OUTDIR/levers.md (per concurrency: the ratios to plain, the crossover, the
# chosen spans, the recommendation).
#
# Usage: LEVERS_PAIR=<dir with target/ and draft/> bash scripts/levers.sh OUTDIR
# Knobs: LEVERS_OPTS (engine options, default device=cuda,dtype=bfloat16,max_model_len=1024: six arms share one
#   GPU, and at the model's max_model_len each arm's pool is smaller than one full-length request needs),
#   LEVERS_TAUS ("6.5 3.5 2.0"), LEVERS_LEVELS (1,8,16,32,64), LEVERS_TRIMS (4,2), LEVERS_GATES (16), LEVERS_POLICIES (off,auto),
#   LEVERS_ROUNDS (2), LEVERS_PPL (prompts per level x C, 4), LEVERS_MAX_TOKENS (128), LEVERS_WARMUP (1),
#   LEVERS_SPREAD (output length spread S: max_tokens uniform in [M (1 - S), M (1 + S)], default 0.5; 0 = all M:
#   the requests of a wave finish together and their successors' prefills share a step, a lockstep plain decode
#   profits from and speculation breaks, reports/h200-levers/2026-12-04-s2/), LEVERS_SECTION (a suffix for the
#   merged section's name; default: the spread), LEVERS_AA (1, the default: a second plain engine, the A/A noise
#   between two engines of one setting, which every arm must beat as well as the noise floor; 0 = without),
#   LEVERS_TIMEOUT (seconds per tau, 540), LEVERS_BUDGET (seconds for the whole call; each tau's timeout is cut
#   to what is left), PYTHON (python3).
# On CPU with the tiny pair (a check of this path, not a measurement):
#   LEVERS_PAIR=harness/data/fixtures/tiny LEVERS_OPTS=device=cpu LEVERS_TAUS=6.5 LEVERS_LEVELS=1,2 \
#   LEVERS_PPL=1 LEVERS_ROUNDS=1 LEVERS_MAX_TOKENS=8 LEVERS_WARMUP=0 LEVERS_GATES=1 PYTHON=.venv/bin/python \
#   bash scripts/levers.sh /tmp/levers
set -uo pipefail
out=${1:?usage: LEVERS_PAIR=<pair dir> bash scripts/levers.sh OUTDIR}
pair=${LEVERS_PAIR:?LEVERS_PAIR: a directory holding target/ and draft/}
py=${PYTHON:-python3}
start=$(date +%s)
mkdir -p "$out"
rc=0
for tau in ${LEVERS_TAUS:-6.5 3.5 2.0}; do
  t=${LEVERS_TIMEOUT:-540}
  if [ -n "${LEVERS_BUDGET:-}" ]; then
    left=$(( LEVERS_BUDGET - ($(date +%s) - start) ))
    [ "$left" -lt 60 ] && { echo "[levers] budget spent: skipping tau $tau"; rc=124; continue; }
    [ "$left" -lt "$t" ] && t=$left
  fi
  echo "[levers] tau $tau (timeout ${t}s)"
  aa=; [ "${LEVERS_AA:-1}" = 1 ] && aa=--aa
  timeout "$t" $py -m specbench tune --each $aa \
    --base "local:$pair/target,draft=$pair/draft,spec=dflash,${LEVERS_OPTS:-device=cuda,dtype=bfloat16,max_model_len=1024},tau=$tau" \
    --trim "${LEVERS_TRIMS:-4,2}" --gate "${LEVERS_GATES:-16}" --policy "${LEVERS_POLICIES:-off,auto}" \
    --concurrency "${LEVERS_LEVELS:-1,8,16,32,64}" --rounds "${LEVERS_ROUNDS:-2}" \
    --prompts-per-level "${LEVERS_PPL:-4}" --max-tokens "${LEVERS_MAX_TOKENS:-128}" --warmup "${LEVERS_WARMUP:-1}" \
    --max-tokens-spread "${LEVERS_SPREAD:-0.5}" \
    --out "$out/results" --json "$out/tau$tau.json" --merge-into "$out/levers.json" --section "synthetic tau $tau${LEVERS_SECTION-, max_tokens spread ${LEVERS_SPREAD:-0.5}}"
  r=$?
  echo "[levers] tau $tau rc=$r"
  [ "$r" = 0 ] || rc=$r
done
exit $rc
