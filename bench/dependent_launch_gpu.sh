#!/usr/bin/env bash
# Dependent launches of the batch-1 weight kernels and the attention (server/fastcore/dependent_launch.py) on the lent
# GPU, one call, .devwheels carried: bench decode 8B at batch 1 (int8, int4; T4 profile, the shipped
# kernel table) with them and without (QUANTSERVE_DEPENDENT_LAUNCH=0: the baseline, same call), the GPU
# test of their bits, then, where 70 s are left, with them again (the run-to-run spread), and with
# END_S >= 400 the step profile of int8 / int4 with them and without (the idle between kernels).
#   bench/dependent_launch_gpu.sh OUT [END_S]   (END_S: every step done by then; default 280)
set -uo pipefail
out=$(realpath -m "$1"); end=${2:-280}; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, log, left, decode, gpu_tests, step_profile
install_site
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) >> "$out/bench.txt"
log "installed"
share=$(( ((end < 400 ? end : 280) - 45) / 2 ))  # the two decodes; with END_S >= 400 as at 280
QUANTSERVE_DEPENDENT_LAUNCH=1 QUANTSERVE_HOME=/tmp/qs-d decode $(left $share) 8b-b1-dependent --models 8b \
    --quants int8,int4 --kernels triton --batches 1
QUANTSERVE_DEPENDENT_LAUNCH=0 QUANTSERVE_HOME=/tmp/qs-d decode $(left $(( 2 * share ))) 8b-b1-ordinary --models 8b \
    --quants int8,int4 --kernels triton --batches 1
gpu_tests $(left $(( 2 * share + 40 ))) "dependent_launch or launcher_inside" "$repo/tests/serve/test_gpu_kernels.py" \
    "$repo/tests/serve/test_paged_attention.py"
if [ $(( end - SECONDS )) -ge 70 ]; then  # time left: with them again (the run-to-run spread)
  QUANTSERVE_DEPENDENT_LAUNCH=1 QUANTSERVE_HOME=/tmp/qs-d decode $(left $(( end < 400 ? end : 2 * share + 110 ))) \
      8b-b1-dependent-again --models 8b --quants int8,int4 --kernels triton --batches 1
fi
if [ $(( end - SECONDS )) -ge 100 ]; then  # and more: the step, kernel by kernel (idle between kernels), both ways
  half=$(( SECONDS + (end - SECONDS) / 2 ))
  QUANTSERVE_DEPENDENT_LAUNCH=1 step_profile $(left $half) dependent --quants int8,int4
  QUANTSERVE_DEPENDENT_LAUNCH=0 step_profile $(left "$end") ordinary --quants int8,int4
fi
cat "$out/bench.txt"
