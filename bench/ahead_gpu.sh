#!/usr/bin/env bash
# The batch-1 weight kernels with each step's weights loaded a step ahead (triton_gemv.LOAD_AHEAD)
# (the default) against the same kernels without (QUANTSERVE_GEMV_AHEAD=0), one call on the lent GPU (~6 min on
# a fresh machine; .devwheels carried): bench decode of the 8B shape at batch 1 (int8, int4; T4
# profile) ahead, without, and ahead again (ABA: the first run also pays the compiles); $TESTS=1
# first runs the GPU tests of the batch-1 kernels (every config in the default loop, each form's
# first config both ways, split K; ~90 s).
# The launcher checks every candidate against the tiled kernel's output before timing it (a
# disagreeing one is left out, said in the log).  Each run has its own QUANTSERVE_HOME,
# so each times and keeps its own kernel choices.
#   [QUANTS=int4] bench/ahead_gpu.sh OUT
set -uo pipefail
out=$(realpath -m "$1"); mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # log, left, decode
install_site
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
log "installed"
if [ "${TESTS:-0}" = 1 ]; then
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-tests timeout 90 python3 -m pytest --import-mode=append -q -p no:cacheprovider -rfs \
      "$repo/tests/serve/test_gemv_forms.py") > "$out/gpu-tests.log" 2>&1 || log "gpu tests: rc=$?"
  grep -E "^FAILED|^SKIPPED|passed|failed" "$out/gpu-tests.log" >> "$out/bench.txt"; log "tests done"
fi
for run in ahead-1 off ahead-2; do
  flag=1; [ "$run" = off ] && flag=0; limit=120; [ "$run" = ahead-1 ] && limit=180
  QUANTSERVE_GEMV_AHEAD=$flag QUANTSERVE_HOME=/tmp/qs-$run decode $(left $(( SECONDS + limit ))) 8b-b1-$run --models 8b \
      --quants ${QUANTS:-int8,int4} --kernels triton --batches 1
  grep -i "warning" "$out/decode-8b-b1-$run.log" | head -n 5 >> "$out/bench.txt"
done
cat "$out/bench.txt"
