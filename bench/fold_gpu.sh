#!/usr/bin/env bash
# The fused batch-1 norm form with int8's norm weights folded into its layers (fused.fold_norms), on
# the lent GPU, in two back-to-back calls (the machine stays warm between them and keeps /tmp and the
# detached llama.cpp build); .devwheels and .devllama carried:
#   bench/fold_gpu.sh OUT 1   install; llama.cpp's build and the 8B GGUFs started detached
#                             (bench/dp4a_gpu.sh's "llama" phase); the fused forms' GPU tests (every
#                             matrix-vector config in every form, the fused ops against the separate
#                             ones in and out of a CUDA graph, a one-token step's kernel count); the
#                             8B decode step kernel by kernel (bench.step_profile): int8 and int4 as
#                             served (gate and residual fused), then int8 with every form (norm folded)
#   bench/fold_gpu.sh OUT 2   bench decode 8B at batch 1: fp16, int8 and int4 as served, unfused and
#                             with every form; llama-bench on Q8_0 / Q4_K_M in the same call; then
#                             bench/cold_start.sh's "shipped" phase (the default forms' compile at start)
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, log, left, decode, llama_bench
if [ "$phase" = 1 ]; then
  install_site .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  log "installed"
  bash bench/dp4a_gpu.sh /tmp/llama-start llama > /dev/null
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-tests timeout 170 python3 -m pytest --import-mode=append -q -p no:cacheprovider \
      -rfs "$repo/tests/serve/test_gemv_forms.py" "$repo/tests/serve/test_gpu_kernels.py" \
      -k "fused_form or fused_ops or fewer_kernels") > "$out/tests.log" 2>&1 || log "tests: rc=$?"
  grep -E "^FAILED|^SKIPPED|passed|failed|Error" "$out/tests.log" | tail -n 12 >> "$out/bench.txt"; log "tests done"
  profile() {  # LIMIT_S NAME ARGS...
    local limit=$1 name=$2; shift 2
    (cd /tmp && QUANTSERVE_HOME=/tmp/qs-prof timeout "$limit" python3 -m quantserve.bench.step_profile --model 8b \
        --prompt-len 0 "$@" --out "$out/profile-$name.json") > "$out/profile-$name.log" 2>&1 || log "profile $name: rc=$?"
    grep -vE "UserWarning|_warn_once" "$out/profile-$name.log" | grep -E "^8b|^    |rror" >> "$out/bench.txt"
  }
  profile $(left 420) default --quants int8,int4
  QUANTSERVE_FUSED_DECODE=1 profile $(left 560) all-forms --quants int8
  log "profiles done"
elif [ "$phase" = 2 ]; then
  QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 250) 8b-b1 --models 8b --quants none,int8,int4 --kernels triton \
      --batches 1 --fusion default,off,on
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt 330 ]; do sleep 2; done
  tail -n 4 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  timeout $(left 585) bash bench/cold_start.sh "$out/cold" shipped > /dev/null 2>&1 || log "cold start: rc=$?"
  cat "$out/cold/bench.txt" >> "$out/bench.txt"; rm -f "$out/cold/"*.log "$out/cold/results.tgz"
else
  echo "fold_gpu.sh: unknown phase '$phase' (1 or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
