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
source "$repo/bench/gpu_lib.sh"  # start_with_llama, gpu_tests, step_profile, llama_bench_8b_then_cold, left, decode
if [ "$phase" = 1 ]; then
  start_with_llama
  gpu_tests 170 "fused_form or fused_ops or fewer_kernels" "$repo/tests/serve/test_gemv_forms.py" \
      "$repo/tests/serve/test_gpu_kernels.py"
  step_profile $(left 420) default --quants int8,int4 --prompt-len 0
  QUANTSERVE_FUSED_DECODE=1 step_profile $(left 560) all-forms --quants int8 --prompt-len 0
  log "profiles done"
elif [ "$phase" = 2 ]; then
  QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 250) 8b-b1 --models 8b --quants none,int8,int4 --kernels triton \
      --batches 1 --fusion default,off,on
  llama_bench_8b_then_cold 330
else
  echo "fold_gpu.sh: unknown phase '$phase' (1 or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
