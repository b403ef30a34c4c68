#!/usr/bin/env bash
# Where a batch-1 decode step of the 8B shape goes on the lent GPU, with the batch-1 kernels' loads
# ahead (bench/step_profile.py), and what a user gets from the kernel table the package ships, one
# call on a fresh machine (~7 min; .devwheels carried):
#   fp16, int8 and int4: the step kernel by kernel, and a 512-token prompt (GPU time, eager);
#   int8 and int4 again with the fused batch-1 forms ($FORMS, default 1: norm, gate and residual
#   inside the weight kernels; e.g. FORMS=gate,residual) — the same-call A/B of the separate kernels above;
#   bench/cold_start.sh's "shipped" phase: the 8B int8 cold and warm, the 8B int4 cold, with the
#   shipped table.  ($COLD=0 leaves that out.)  MERGE=last: int8 and int4 once more with the paged
#   attention's split keys merged by the last program ($QUANTSERVE_ATTENTION_MERGE), after its GPU
#   tests (the kernel against the reference both ways, CUDA-graphed decodes against eager); with it,
#   COLD=0 (the tests, up to 150 s, and the cold starts would not fit one 10-minute call together).
#   bench/profile_gpu.sh OUT
set -uo pipefail
out=$(realpath -m "$1"); mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # log, left
install_site
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
log "installed"
if [ -n "${MERGE:-}" ]; then  # the merge's GPU tests first: a wrong merge would time as well as a right one
  (cd /tmp && QUANTSERVE_ATTENTION_MERGE=$MERGE QUANTSERVE_HOME=/tmp/qs-tests timeout 150 python3 -m pytest \
      --import-mode=append -q -p no:cacheprovider -rfs "$repo/tests/serve/test_paged_attention.py" \
      "$repo/tests/serve/test_fastcore.py" -k "reference or counters or compiled_cuda_decode_matches_eager or replayed") \
      > "$out/merge-tests.log" 2>&1 || log "merge tests: rc=$?"
  grep -E "^FAILED|^SKIPPED|passed|failed" "$out/merge-tests.log" >> "$out/bench.txt"; log "merge tests done"
fi
profile() {  # LIMIT_S NAME ARGS...
  local limit=$1 name=$2; shift 2
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-prof timeout "$limit" python3 -m quantserve.bench.step_profile --model 8b \
      "$@" --out "$out/profile-$name.json") > "$out/profile-$name.log" 2>&1 || log "profile $name: rc=$?"
  grep -vE "UserWarning|_warn_once" "$out/profile-$name.log" | grep -E "^8b|^    |prompt of|rror" >> "$out/bench.txt"
}
base=$SECONDS  # the marks below count from here (after the merge's tests, if any)
profile $(left $((base + 180))) separate --quants none,int8,int4 --prompt-len 512
QUANTSERVE_FUSED_DECODE=${FORMS:-1} profile $(left $((base + 280))) fused --quants int8,int4 --prompt-len 0
# MERGE=last: the separate kernels again with split keys merged by the last program (no merge kernel)
[ -z "${MERGE:-}" ] || QUANTSERVE_ATTENTION_MERGE=$MERGE profile $(left $((base + 370))) merge-$MERGE --quants int8,int4 --prompt-len 0
log "profiles done"
if [ "${COLD:-1}" = 1 ]; then
  timeout $(left $((base + 510))) bash bench/cold_start.sh "$out/cold" shipped > /dev/null 2>&1 || log "cold start: rc=$?"
  cat "$out/cold/bench.txt" >> "$out/bench.txt"; rm -f "$out/cold/"*.log "$out/cold/results.tgz"
fi
cat "$out/bench.txt"
