#!/usr/bin/env bash
# A decode step's rotary embedding and cache write inside the paged attention kernel
# (fastcore/attention.py, QUANTSERVE_ATTENTION_NEW_KV) on the lent GPU, in two back-to-back calls on
# one machine (it keeps /tmp and the detached llama.cpp build); .devwheels and .devllama carried:
#   bench/new_kv_gpu.sh OUT 1  install; llama.cpp's build and the 8B GGUFs started detached (bench/dp4a_gpu.sh
#                              "llama"); GPU tests: the attention kernels against the reference (fp16 too),
#                              the compiled, CUDA-graphed decode against eager (fp32; int8 through our
#                              kernels); the 8B decode step kernel by kernel, int8 and int4, and int8 with
#                              QUANTSERVE_ATTENTION_NEW_KV=0 (same call); bench decode at batch 8 and 32
#                              (fp16, int8, int4)
#   bench/new_kv_gpu.sh OUT 2  bench decode 8B at batch 1 (fp16, int8, int4; int8 with NEW_KV=0), then
#                              llama-bench on Q8_0 / Q4_K_M in the same call; bench/cold_start.sh "shipped"
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # start_with_llama, gpu_tests, step_profile, llama_bench_8b_then_cold, left, decode
if [ "$phase" = 1 ]; then
  start_with_llama
  gpu_tests 200 "not test_fastcore or compiled_cuda_decode_matches_eager or (compiled_triton_decode and int8 and not gemlite)" \
      "$repo/tests/serve/test_paged_attention.py" "$repo/tests/serve/test_fastcore.py"
  step_profile $(left 400) default --quants int8,int4 --prompt-len 0
  QUANTSERVE_ATTENTION_NEW_KV=0 step_profile $(left 470) separate-kv --quants int8 --prompt-len 0
  log "profiles done"
  QUANTSERVE_HOME=/tmp/qs-b832 decode $(left 585) 8b-b8-b32 --models 8b --quants none,int8,int4 --kernels triton \
      --batches 8,32
elif [ "$phase" = 2 ]; then
  QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 150) 8b-b1 --models 8b --quants none,int8,int4 --kernels triton --batches 1
  QUANTSERVE_ATTENTION_NEW_KV=0 QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 200) 8b-b1-separate-kv --models 8b \
      --quants int8 --kernels triton --batches 1
  llama_bench_8b_then_cold 300
else
  echo "new_kv_gpu.sh: unknown phase '$phase' (1 or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
