#!/usr/bin/env bash
# The sm_90 prompt kernels (server/fastcore/triton_wgmma.py: TMA-fed tiles, the weight dequantized in
# registers as wgmma's first operand) on the lent GPU:
#   bench/wgmma_gpu.sh OUT race     install; their GPU tests; the per-layer race of the 8B's prompt-sized
#                                   matmuls (256, 512 and 2,048 rows: fp16 cuBLAS, the same tiles on the
#                                   fp16 weight, dequantize-then-cuBLAS, the 128-row tiles, the wgmma
#                                   kernels), then the 1B's layers at 512 rows
#   bench/wgmma_gpu.sh OUT serve    install; the launcher's GPU tests; the 8B's race again; the step
#                                   profile's prompt steps replayed from CUDA graphs (256, 512, 2,048
#                                   tokens; fp16, int8, int4) and batch-1 decode, 8B, T4 profile, all in
#                                   one process; its prompt rows merged into a copy of the shipped tables
#   bench/wgmma_gpu.sh OUT all      install; the wgmma, launcher and table GPU tests; serve's profile and rows;
#                                   with time left, the race of gate_up at 512 rows (fp16, the wgmma
#                                   kernels' every config, int8 in both forms)
#   bench/wgmma_gpu.sh OUT choices  install; the wgmma GPU tests; serve's profile and rows; two fresh-cache
#                                   int4 decodes at batch 1 (do the start-up choices agree, and at what
#                                   speed); with time left, the 8B's four layers at 512 rows, every config
#   bench/wgmma_gpu.sh OUT prompts  install; the wgmma GPU tests; serve's profile and rows ($QUANTS: which)
# Run from the repo root with .devwheels carried.  race ends by 420 s, serve by ~520 s, all by ~280 s,
# choices by 585 s.
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, log, left, gpu_tests, step_profile
install_site; (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
log "installed"
race() {  # UNTIL_S SHAPE LAYERS BATCHES NAME ($KINDS: the kinds, default below)
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-race timeout $(left "$1") python3 -m quantserve.bench.kernel_race --shapes "$2" \
      --layers "$3" --batches "$4" \
      --kinds "${KINDS:-fp16,fp16-wgmma,int8-dense,int8-tiles,int8-wgmma,int4-dense,int4-wgmma}" --out "$out/race-$5.json") \
      > "$out/race-$5.log" 2>&1 || log "race $5: rc=$?"
  grep -E "M=|copy bandwidth|rror" "$out/race-$5.log" >> "$out/bench.txt"; log "race $5 done"
}
serve_profile() {  # UNTIL_S: the 8B's prompt steps from CUDA graphs and batch-1 decode ($QUANTS: fp16, int8, int4);
  # then the prompt rows it tuned (the wgmma kernels among the candidates) merged into a copy of the
  # shipped tables: the rows a table for this GPU would take
  step_profile $(left "$1") prompts --quants "${QUANTS:-none,int8,int4}" --kernel triton --steps 8 --prompt-len 512 \
      --graph-prompts 256,512,2048 --save-choices "$out/choices.json"
  cp -r "$repo/server/fastcore/kernel_tables" "$out/tables"
  python3 - "$out/prompt-rows.json" "$out/choices.json" <<'PY'
import json, sys
rows = [r for f in sys.argv[2:] for r in json.load(open(f)) if r["key"][1] > 64 and not r["key"][2]]
json.dump(rows, open(sys.argv[1], "w"), indent=1)
print(len(rows), "prompt rows")
PY
  (cd /tmp && python3 -m quantserve.bench.kernel_table --gpu "$(python3 -c 'import torch; print(torch.cuda.get_device_name())')" \
      --out "$out/tables" "$out/prompt-rows.json") >> "$out/bench.txt" 2>&1 || log "kernel_table: rc=$?"
}
if [ "$phase" = race ]; then
  gpu_tests $(left 120) "wgmma" "$repo/tests/serve/test_gpu_kernels.py"
  race 330 8b qkv,o,gate_up,down 256,512,2048 8b
  race 420 1b qkv,o,gate_up,down 512 1b
elif [ "$phase" = serve ]; then
  gpu_tests $(left 150) "wgmma or launcher or prompt_tile or shipped_table or dense" "$repo/tests/serve/test_gpu_kernels.py"
  race 230 8b qkv,o,gate_up,down 256,512,2048 8b
  serve_profile 500
elif [ "$phase" = all ]; then
  gpu_tests $(left 130) "wgmma or shipped_table or launcher or candidates_are_timed" "$repo/tests/serve/test_gpu_kernels.py"
  serve_profile 270
  [ "$SECONDS" -lt 250 ] && KINDS=fp16,int8-wgmma,int4-wgmma race 280 8b gate_up 512 8b
elif [ "$phase" = choices ]; then
  gpu_tests $(left 110) "wgmma" "$repo/tests/serve/test_gpu_kernels.py"
  serve_profile 330
  for i in 1 2; do  # each a fresh start that tunes batch 1 (no table); it prints the forms it kept
    QUANTSERVE_HOME=/tmp/qs-b1-$i decode $(left $((330 + 60 * i))) int4-b1-$i --models 8b --quants int4 \
        --kernels triton --batches 1
  done
  KINDS=fp16,int8-wgmma,int4-wgmma race 585 8b qkv,o,gate_up,down 512 8b
elif [ "$phase" = prompts ]; then
  gpu_tests $(left 110) "wgmma" "$repo/tests/serve/test_gpu_kernels.py"
  serve_profile 400
else
  echo "wgmma_gpu.sh: unknown phase '$phase' (race, serve, all, choices or prompts)" >&2; exit 2
fi
# at most 8 files come back from the machine: the logs' lines that matter are in bench.txt already
rm -f "$out"/profile-*.log "$out"/race-*.log "$out"/decode-*.log "$out/tests.log" "$out/prompt-rows.json"
cat "$out/bench.txt"
