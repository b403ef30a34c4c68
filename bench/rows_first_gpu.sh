#!/usr/bin/env bash
# Prompt tiles with their row tiles first in the grid (triton_mm.tiled_grid) and dependent launches
# (server/fastcore/dependent_launch.py) on the lent GPU, with llama-bench's baseline, in two
# back-to-back calls (the machine stays warm between them and keeps /tmp and the detached build):
#   bench/rows_first_gpu.sh OUT 1   install; llama.cpp's build and the 8B GGUFs started detached; the
#                                   per-layer race of the 8B's prompt-sized matmuls (512 and 2,048 rows:
#                                   fp16, dequantize-then-cuBLAS, the 128-row tiles row tiles first and
#                                   output tiles first); the GPU tests of the tiles and the dependent
#                                   launches; bench decode 8B at batch 1 (int8, int4) with dependent
#                                   launches and without (the baseline, same call)
#   bench/rows_first_gpu.sh OUT race  the least device time: install, then the race at 512 rows alone
#                                   (by $END s, default 170)
#   bench/rows_first_gpu.sh OUT 2   llama-bench on Q8_0 / Q4_K_M (waiting for the GGUFs); bench decode
#                                   8B at batch 1 (int8, int4); the step profile of the 8B (fp16,
#                                   int8, int4) and its 512-token prompt (both tune their kernels on this
#                                   machine, as bench decode does); QUANTSERVE_DEPENDENT_LAUNCH as exported
# Run from the repo root with .devwheels and .devllama carried.  Phase 1 ends by 440 s, phase 2 by 440.
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, log, left, decode, llama_bench, gpu_tests, step_profile
race() {  # UNTIL_S BATCHES: the 8B's four layers, fp16 / dense / tiles row tiles first / output tiles first
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-race timeout $(left "$1") python3 -m quantserve.bench.kernel_race --shapes 8b \
      --layers qkv,o,gate_up,down --batches "$2" \
      --kinds fp16,int8-dense,int8-tiles,int8-coltiles,int4-dense,int4-tiles,int4-coltiles --out "$out/race-prompt.json") \
      > "$out/race-prompt.log" 2>&1 || log "race: rc=$?"
  grep -E "M=|copy bandwidth" "$out/race-prompt.log" >> "$out/bench.txt"; log "race done"
}
if [ "$phase" = 1 ] && [ "${LLAMA:-1}" = 1 ]; then start_with_llama  # LLAMA=0: no second call will follow
elif [ "$phase" = 1 ] || [ "$phase" = race ]; then
  install_site; (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
fi
if [ "$phase" = race ]; then
  race "${END:-170}" 512
elif [ "$phase" = 1 ]; then
  race 150 512,2048
  gpu_tests $(left 250) "prompt_tile or tile_config_at_decode or dependent_launch or launcher_inside" \
      "$repo/tests/serve/test_gpu_kernels.py" "$repo/tests/serve/test_paged_attention.py"
  QUANTSERVE_DEPENDENT_LAUNCH=1 QUANTSERVE_HOME=/tmp/qs-d decode $(left 345) 8b-b1-dependent --models 8b \
      --quants int8,int4 --kernels triton --batches 1
  QUANTSERVE_DEPENDENT_LAUNCH=0 QUANTSERVE_HOME=/tmp/qs-d decode $(left 440) 8b-b1-ordinary --models 8b \
      --quants int8,int4 --kernels triton --batches 1
elif [ "$phase" = 2 ]; then
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt 120 ]; do sleep 2; done
  tail -n 4 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  QUANTSERVE_HOME=/tmp/qs-2 decode $(left 250) 8b-b1 --models 8b --quants int8,int4 --kernels triton --batches 1
  step_profile $(left 440) prompts --quants none,int8,int4 --kernel triton --steps 8 --prompt-len 512
else
  echo "rows_first_gpu.sh: unknown phase '$phase' (1, race or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
