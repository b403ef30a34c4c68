#!/usr/bin/env bash
# Where a batch-1 decode step of the 8B shape goes on the lent GPU, with the batch-1 kernels' loads
# ahead (bench/step_profile.py), and what a user gets from the kernel table the package ships, one
# call on a fresh machine (~7 min; .devwheels carried):
#   fp16, int8 and int4: the step kernel by kernel, and a 512-token prompt (GPU time, eager);
#   int8 and int4 again with the fused batch-1 forms ($FORMS, default 1: norm, gate and residual
#   inside the weight kernels; e.g. FORMS=gate,residual) — the same-call A/B of the separate kernels above;
#   bench/cold_start.sh's "shipped" phase: the 8B int8 cold and warm, the 8B int4 cold, with the
#   shipped table.  ($COLD=0 leaves that out.)
#   bench/profile_gpu.sh OUT
set -uo pipefail
out=$(realpath -m "$1"); mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, step_profile, log, left
install_site
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
log "installed"
base=$SECONDS
step_profile $(left $((base + 180))) separate --quants none,int8,int4 --prompt-len 512
QUANTSERVE_FUSED_DECODE=${FORMS:-1} step_profile $(left $((base + 280))) fused --quants int8,int4 --prompt-len 0
log "profiles done"
if [ "${COLD:-1}" = 1 ]; then
  timeout $(left $((base + 510))) bash bench/cold_start.sh "$out/cold" shipped > /dev/null 2>&1 || log "cold start: rc=$?"
  cat "$out/cold/bench.txt" >> "$out/bench.txt"; rm -f "$out/cold/"*.log "$out/cold/results.tgz"
fi
cat "$out/bench.txt"
