#!/usr/bin/env bash
# Issue 20's batch-1 rows on an H200 again (8B, T4 profile, the shipped H200 kernel table), in two
# back-to-back calls on one machine (it keeps /tmp and the detached llama.cpp build); .devwheels
# and .devllama carried:
#   bench/h200_rows_gpu.sh OUT 1  install; llama.cpp's build and the 8B GGUFs started detached; bench decode 8B
#                                 at batch 1 (int8, int4, fp16), then at batch 8 and 32 (fp16, int8, int4)
#   bench/h200_rows_gpu.sh OUT 2  llama-bench on Q8_0 / Q4_K_M (waiting for the GGUFs), then bench decode 8B at
#                                 batch 1 (int8, int4, fp16) in the same call
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # start_with_llama, llama_bench, left, decode
if [ "$phase" = 1 ]; then
  start_with_llama
  QUANTSERVE_HOME=/tmp/qs-r decode $(left 200) 8b-b1-first --models 8b --quants int8,int4,none --kernels triton --batches 1
  QUANTSERVE_HOME=/tmp/qs-r decode $(left 480) 8b-b8-b32 --models 8b --quants none,int8,int4 --kernels triton \
      --batches 8,32
  tail -n 3 /tmp/llama-build.out /tmp/ggufs.log >> "$out/bench.txt" 2>/dev/null
elif [ "$phase" = 2 ]; then
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt 330 ]; do sleep 2; done
  tail -n 4 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  QUANTSERVE_HOME=/tmp/qs-r decode $(left 560) 8b-b1 --models 8b --quants int8,int4,none --kernels triton --batches 1
else
  echo "h200_rows_gpu.sh: unknown phase '$phase' (1 or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
