#!/usr/bin/env bash
# A decode step's attention on the lent GPU: the merge of split keys in one round of loads
# (QUANTSERVE_ATTENTION_MERGE_ROUND=1, triton_paged_attention._merge_round_kernel) and the decode tile,
# keys x warps (QUANTSERVE_ATTENTION_DECODE_TILE), against the defaults (the merge one chunk at a
# time, 64 x 4) in the same call.  Two back-to-back calls (the machine keeps /tmp and the detached
# llama.cpp build), or one:
#   bench/attention_gpu.sh OUT 1    install; llama.cpp's build and the 8B GGUFs detached; the attention GPU
#                                   tests; the wgmma configs' test (the race's configs too); bench.attention_split
#                                   as by default, then with the one-round merge at each of $TILES (batches
#                                   1, 8, 32); the merge, tile and short context that give batch 1 and 8 the
#                                   least time, into /tmp/attention-picks.env
#   bench/attention_gpu.sh OUT 2    bench decode 8B at batch 1 (int8, int4) with the picks, then as by default
#                                   (the baseline), fp16 with the picks; llama-bench on Q8_0 / Q4_K_M
#   bench/attention_gpu.sh OUT one  a single call without llama.cpp: call 1's tests and timings (fewer
#                                   contexts and tiles), then bench decode 8B batch 1 with the picks and
#                                   by default, int4 then int8, while time is left (by ~585 s)
#   bench/attention_gpu.sh OUT short  as "one" in ~420 s, for a call with less device time left: the
#                                   attention GPU tests only, two tiles, four contexts, int4 only
#   bench/attention_gpu.sh OUT split  the attention timings alone in ~240 s: bench.attention_split as by
#                                   default, then with the one-round merge at 64x4 and 64x8 (four contexts)
# Run from the repo root with .devwheels (and for call 1, .devllama) carried.
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, log, left, decode, llama_bench, gpu_tests, start_with_llama
split_bench() {  # UNTIL_S NAME ARGS...: bench.attention_split on the 8B shape, batches 1, 8 and 32
  local until=$1 name=$2; shift 2
  (cd /tmp && timeout $(left "$until") python3 -m quantserve.bench.attention_split --shape 8b --batches 1,8,32 \
      --contexts "${CONTEXTS:-64,128,192,256,384,512,768,1024,2048}" --out "$out/split-$name.json" "$@") \
      > "$out/split-$name.log" 2>&1 || log "split $name: rc=$?"
  grep -E "batch|rror" "$out/split-$name.log" >> "$out/bench.txt"; log "split $name done"; stash_logs
}
stash_logs() {  # at most 8 files come back from the machine, even from a call cut short: logs kept apart
  mkdir -p /tmp/attention-logs; mv "$out"/*.log /tmp/attention-logs/ 2>/dev/null || true
}
picks() {  # the one-round merge, and the tile and short context with the least time at batch 1 and 8
  python3 - "$out/split-round.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
best = lambda r: min(r["split_us"], r["one_program_us"])  # noqa: E731
tile = min({r["tile"] for r in rows}, key=lambda t: sum(best(r) for r in rows if r["tile"] == t
                                                         and r["batch"] in (1, 8) and r["context"] <= 512))
short = 16  # the longest context up to which one program beats split keys at batch 1 (16: one block)
for r in sorted((r for r in rows if r["tile"] == tile and r["batch"] == 1), key=lambda r: r["context"]):
    if r["one_program_us"] >= r["split_us"]:
        break
    short = r["context"]
print(f"QUANTSERVE_ATTENTION_MERGE_ROUND=1 QUANTSERVE_ATTENTION_DECODE_TILE={tile} "
      f"QUANTSERVE_ATTENTION_SHORT_CONTEXT={short}")
PY
}
if [ "$phase" = split ]; then
  install_site
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  log "installed"
  CONTEXTS=64,256,1024,2048 split_bench 120 default
  CONTEXTS=64,256,1024,2048 QUANTSERVE_ATTENTION_MERGE_ROUND=1 split_bench 240 round --decode-tiles 64x4,64x8 \
      --plot "$out/split-round.png"
  picks >> "$out/bench.txt"
elif [ "$phase" = short ]; then
  install_site
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  log "installed"
  gpu_tests $(left 100) "" "$repo/tests/serve/test_paged_attention.py"; stash_logs
  CONTEXTS=64,256,1024,2048 split_bench 170 default
  CONTEXTS=64,256,1024,2048 QUANTSERVE_ATTENTION_MERGE_ROUND=1 split_bench 260 round --decode-tiles 64x4,64x8 \
      --plot "$out/split-round.png"
  picks > /tmp/attention-picks.env; cat /tmp/attention-picks.env >> "$out/bench.txt"
  (export $(cat /tmp/attention-picks.env); QUANTSERVE_HOME=/tmp/qs-new decode $(left 340) 8b-b1-int4-picks \
      --models 8b --quants int4 --kernels triton --batches 1); stash_logs
  QUANTSERVE_HOME=/tmp/qs-default decode $(left 420) 8b-b1-int4-default --models 8b --quants int4 --kernels triton \
      --batches 1; stash_logs
elif [ "$phase" = 1 ] || [ "$phase" = one ]; then
  if [ "$phase" = 1 ]; then
    start_with_llama  # .devwheels and the GGUF writer, the GPU named in bench.txt, llama.cpp and the GGUFs detached
  else
    install_site
    (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
    export CONTEXTS=${CONTEXTS:-64,128,192,256,512,1024,2048} TILES=${TILES:-64x4,64x8,128x8}; log "installed"
  fi
  gpu_tests $(left 150) "" "$repo/tests/serve/test_paged_attention.py"; stash_logs
  gpu_tests $(left 230) "compiled_cuda_decode or every_wgmma_prompt_config" "$repo/tests/serve/test_fastcore.py" \
      "$repo/tests/serve/test_gpu_kernels.py"; stash_logs
  split_bench 300 default
  QUANTSERVE_ATTENTION_MERGE_ROUND=1 split_bench 420 round --decode-tiles "${TILES:-64x4,64x8,128x8,32x4}" \
      --plot "$out/split-round.png"
  picks > /tmp/attention-picks.env; cat /tmp/attention-picks.env >> "$out/bench.txt"
  if [ "$phase" = one ]; then
    for q in int4 int8; do
      [ "$SECONDS" -lt 445 ] || break
      (export $(cat /tmp/attention-picks.env); QUANTSERVE_HOME=/tmp/qs-new decode $(left $((SECONDS + 70))) \
          8b-b1-$q-picks --models 8b --quants $q --kernels triton --batches 1)
      QUANTSERVE_HOME=/tmp/qs-default decode $(left $((SECONDS + 70))) 8b-b1-$q-default --models 8b --quants $q \
          --kernels triton --batches 1
    done
  fi
elif [ "$phase" = 2 ]; then
  log "picks: $(cat /tmp/attention-picks.env)"
  (export $(cat /tmp/attention-picks.env); QUANTSERVE_HOME=/tmp/qs-new decode $(left 160) 8b-b1-picks --models 8b \
      --quants int8,int4 --kernels triton --batches 1)
  QUANTSERVE_HOME=/tmp/qs-default decode $(left 310) 8b-b1-default --models 8b --quants int8,int4 --kernels triton \
      --batches 1
  (export $(cat /tmp/attention-picks.env); QUANTSERVE_HOME=/tmp/qs-new decode $(left 380) 8b-b1-picks-fp16 \
      --models 8b --quants none --kernels triton --batches 1)
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt 450 ]; do sleep 2; done
  tail -n 4 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  [ "$SECONDS" -gt 470 ] || (export $(cat /tmp/attention-picks.env); QUANTSERVE_HOME=/tmp/qs-new \
      decode $(left 585) 8b-b1-picks-2 --models 8b --quants int8,int4 --kernels triton --batches 1)
else
  echo "attention_gpu.sh: unknown phase '$phase' (1, 2, one, short or split)" >&2; exit 2
fi
# at most 8 files come back from the machine: the logs' lines that matter are in bench.txt already
rm -f "$out"/split-*.log "$out"/decode-*.log "$out/tests.log"
cat "$out/bench.txt"
