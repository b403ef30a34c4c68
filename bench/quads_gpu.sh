#!/usr/bin/env bash
# int4's batch-1 kernel with four words a thread and row (triton_dp4a.quad_sums, the QUADS flag):
# one scale and zero point loaded for four words.  Two back-to-back calls on one machine (it keeps
# /tmp and the detached llama.cpp build); .devwheels and .devllama carried:
#   bench/quads_gpu.sh OUT 1  install; llama.cpp's build and the 8B GGUFs started detached; the GPU tests of the
#                             batch-1 kernels (QUADS in every fused form and config); kernel_race at batch 1
#                             (8B: fp16, the launcher's int4, the one-word dp4a form, the four-words form);
#                             bench decode 8B int4 at batch 1 tuned at start-up (no shipped table) with the
#                             four-words form allowed, then without (QUANTSERVE_GEMV_QUADS=0); int8, fp16
#   bench/quads_gpu.sh OUT solo  phase 1 without llama.cpp (installs, no build started)
#   bench/quads_gpu.sh OUT short kernel_race and the two int4 decodes only (~240 s)
#   bench/quads_gpu.sh OUT 2  llama-bench on Q8_0 / Q4_K_M once the GGUFs exist, then bench decode 8B at batch 1
#                             in the same call (int4 tuned at start-up with and without the form, int8, fp16)
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # start_with_llama, gpu_tests, llama_bench, left, decode
b1() {  # LIMIT_S NAME QUADS QUANTS: bench decode 8B at batch 1, int4 tuned at start-up (no table)
  QUANTSERVE_KERNEL_TABLES=0 QUANTSERVE_GEMV_QUADS=$3 QUANTSERVE_HOME=/tmp/qs-q$3 decode "$1" "$2" --models 8b \
      --quants "$4" --kernels triton --batches 1
}
race() {  # MARK_S: kernel_race at batch 1 on the 8B layers, the four-words form allowed in the launcher's choice
  (cd /tmp && QUANTSERVE_GEMV_QUADS=1 timeout $(left "$1") python3 -m quantserve.bench.kernel_race --shapes 8b \
      --batches 1 --kinds fp16,int4,int4-dp4a,int4-quads --out "$out/race.json") > "$out/race.log" 2>&1 || log "race: rc=$?"
  grep -E "^8b|copy bandwidth" "$out/race.log" >> "$out/bench.txt"
}
if [ "$phase" = 1 ] || [ "$phase" = solo ]; then
  if [ "$phase" = 1 ]; then start_with_llama; else
    install_site; (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  fi
  gpu_tests 45 "four_words or every_matrix_vector_config or large_activations" \
      "$repo/tests/serve/test_gemv_forms.py" "$repo/tests/serve/test_gpu_kernels.py"
  race 115
  b1 $(left 200) 8b-b1-int4-quads 1 int4
  b1 $(left 285) 8b-b1-int4-one-word 0 int4
  QUANTSERVE_HOME=/tmp/qs-t decode $(left 370) 8b-b1-int8-fp16 --models 8b --quants int8,none --kernels triton --batches 1
  tail -n 3 /tmp/llama-build.out /tmp/ggufs.log >> "$out/bench.txt" 2>/dev/null
elif [ "$phase" = short ]; then
  install_site; (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  race 80
  b1 $(left 160) 8b-b1-int4-quads 1 int4
  b1 $(left 238) 8b-b1-int4-one-word 0 int4
elif [ "$phase" = 2 ]; then
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt 300 ]; do sleep 2; done
  tail -n 4 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  b1 $(left 420) 8b-b1-int4-quads 1 int4
  b1 $(left 500) 8b-b1-int4-one-word 0 int4
  QUANTSERVE_HOME=/tmp/qs-t decode $(left 590) 8b-b1-int8-fp16 --models 8b --quants int8,none --kernels triton --batches 1
else
  echo "quads_gpu.sh: unknown phase '$phase' (1 or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
