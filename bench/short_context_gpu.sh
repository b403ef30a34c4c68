#!/usr/bin/env bash
# Decode steps within a short context attend without split keys (fastcore/attention.py,
# QUANTSERVE_ATTENTION_SHORT_CONTEXT; graphs.py records a decode graph for each side) on the lent GPU,
# in two back-to-back calls on one machine (it keeps /tmp and the detached llama.cpp build);
# .devwheels and .devllama carried:
#   bench/short_context_gpu.sh OUT 1  install; llama.cpp's build and the 8B GGUFs started detached; GPU tests:
#                                     the attention kernels against the reference, both sides of the short
#                                     context, the compiled, CUDA-graphed decode against eager (both graphs);
#                                     bench decode 8B int8 at batch 1, and with QUANTSERVE_ATTENTION_SHORT_CONTEXT=0
#                                     (split keys at every length, as before); bench.attention_split (8B shape,
#                                     batch 1/8/32, contexts 64-2,048); the 8B int8 decode step kernel by kernel
#   bench/short_context_gpu.sh OUT 2  bench decode 8B at batch 1 (fp16, int8, int4; int8 and int4 with the short
#                                     context off), then llama-bench on Q8_0 / Q4_K_M in the same call; bench
#                                     decode at batch 8 and 32 (fp16, int8, int4) in what time is left
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # start_with_llama, gpu_tests, step_profile, llama_bench_8b_then_cold, left, decode
if [ "$phase" = 1 ]; then
  start_with_llama
  gpu_tests 230 "not test_fastcore or compiled_cuda_decode_matches_eager or (compiled_triton_decode and int8 and not gemlite)" \
      "$repo/tests/serve/test_paged_attention.py" "$repo/tests/serve/test_fastcore.py"
  QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 350) 8b-b1-int8 --models 8b --quants int8 --kernels triton --batches 1
  QUANTSERVE_ATTENTION_SHORT_CONTEXT=0 QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 410) 8b-b1-int8-split-keys \
      --models 8b --quants int8 --kernels triton --batches 1
  (cd /tmp && timeout $(left 500) python3 -m quantserve.bench.attention_split --shape 8b --batches 1,8,32 \
      --out "$out/attention-split.json") > "$out/attention-split.log" 2>&1 || log "attention_split: rc=$?"
  grep -vE "Warning|warn" "$out/attention-split.log" >> "$out/bench.txt"
  step_profile $(left 560) short --quants int8 --prompt-len 0
elif [ "$phase" = 2 ]; then
  QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 150) 8b-b1 --models 8b --quants none,int8,int4 --kernels triton --batches 1
  QUANTSERVE_ATTENTION_SHORT_CONTEXT=0 QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 230) 8b-b1-split-keys --models 8b \
      --quants int8,int4 --kernels triton --batches 1
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt 330 ]; do sleep 2; done
  tail -n 4 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 540) 8b-b8-b32 --models 8b --quants none,int8,int4 --kernels triton \
      --batches 8,32
else
  echo "short_context_gpu.sh: unknown phase '$phase' (1 or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
