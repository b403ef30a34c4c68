#!/usr/bin/env bash
# A decode step's attention on the lent GPU (server/fastcore/triton_paged_attention.py: the merge of
# split keys in one round of loads; the decode tile, keys x warps, attention.decode_tile) against the
# base commit's package, in two back-to-back calls (the machine keeps /tmp and the detached build):
#   bench/attention_gpu.sh OUT 1   install this tree, and the base into /tmp/site-base (.devbase: the base
#                                  commit's package folders, `git archive BASE -- quantserve server quant
#                                  training bench pyproject.toml ':!bench/results' ':!quantserve/demo/assets'`);
#                                  llama.cpp's build and the 8B GGUFs detached; the attention GPU tests and
#                                  the wgmma configs' test; bench.attention_split of the base, then of this
#                                  tree at each of $TILES (batches 1, 8, 32); the tile and short context that
#                                  give batch 1 and 8 the least time, into /tmp/attention-picks.env
#   bench/attention_gpu.sh OUT 2   bench decode 8B at batch 1 (int8, int4; fp16) with those picks, the base
#                                  the same in this call; llama-bench on Q8_0 / Q4_K_M once the GGUFs exist
#   bench/attention_gpu.sh OUT one a single call (no llama.cpp): call 1's tests and timings ($CONTEXTS,
#                                  $TILES shorter), then bench decode 8B batch 1 with the picks and the
#                                  base, int4 then int8, alternating, while time is left (by 585 s)
# Run from the repo root with .devwheels, .devllama and .devbase carried.  Call 1 ends by ~420 s.
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, log, left, decode, llama_bench, gpu_tests
split_bench() {  # UNTIL_S NAME SITE ARGS...: bench.attention_split with the package in SITE
  local until=$1 name=$2 where=$3; shift 3
  (cd /tmp && PYTHONPATH=$where timeout $(left "$until") python3 -m quantserve.bench.attention_split --shape 8b \
      --batches 1,8,32 --contexts "${CONTEXTS:-64,128,192,256,384,512,768,1024,2048}" --out "$out/split-$name.json" "$@") > "$out/split-$name.log" 2>&1 || log "split $name: rc=$?"
  grep -E "batch|rror" "$out/split-$name.log" >> "$out/bench.txt"; log "split $name done"
}
if [ "$phase" = 1 ] || [ "$phase" = one ]; then
  if [ "$phase" = 1 ]; then
    start_with_llama  # .devwheels and the GGUF writer, the GPU named in bench.txt, llama.cpp and the GGUFs detached
  else
    install_site; (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
    export CONTEXTS=${CONTEXTS:-64,128,192,256,512,1024,2048} TILES=${TILES:-64x4,64x8,128x8}; log "installed"
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site-base .devbase 2>&1 \
      | grep -v WARNING; log "base installed"
  gpu_tests $(left 150) "" "$repo/tests/serve/test_paged_attention.py"
  gpu_tests $(left 230) "compiled_cuda_decode or every_wgmma_prompt_config" "$repo/tests/serve/test_fastcore.py" \
      "$repo/tests/serve/test_gpu_kernels.py"
  split_bench 300 base /tmp/site-base:$site
  split_bench 420 tiles $site --decode-tiles "${TILES:-64x4,64x8,128x8,32x4}" --plot "$out/split-tiles.png"
  python3 - "$out/split-tiles.json" > /tmp/attention-picks.env <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
best = lambda r: min(r["split_us"], r["one_program_us"])  # noqa: E731
tiles = {r["tile"] for r in rows}
# the tile with the least time at batch 1 and 8 up to 512 keys, either side of the short context
tile = min(tiles, key=lambda t: sum(best(r) for r in rows if r["tile"] == t and r["batch"] in (1, 8)
                                    and r["context"] <= 512))
# the short context: the longest context up to which one program beats split keys at batch 1
short = 16
for r in sorted((r for r in rows if r["tile"] == tile and r["batch"] == 1), key=lambda r: r["context"]):
    if r["one_program_us"] >= r["split_us"]:
        break
    short = r["context"]
print(f"QUANTSERVE_ATTENTION_DECODE_TILE={tile}\nQUANTSERVE_ATTENTION_SHORT_CONTEXT={short}")
PY
  cat /tmp/attention-picks.env >> "$out/bench.txt"
  if [ "$phase" = one ]; then
    picks=$(tr '\n' ' ' < /tmp/attention-picks.env)
    for q in int4 int8; do
      [ "$SECONDS" -lt 445 ] || break
      (export $picks; QUANTSERVE_HOME=/tmp/qs-new decode $(left $((SECONDS + 70))) 8b-b1-$q-new --models 8b \
          --quants $q --kernels triton --batches 1)
      site=/tmp/site-base:$site QUANTSERVE_HOME=/tmp/qs-base decode $(left $((SECONDS + 70))) 8b-b1-$q-base \
          --models 8b --quants $q --kernels triton --batches 1
    done
  fi
elif [ "$phase" = 2 ]; then
  picks=$(tr '\n' ' ' < /tmp/attention-picks.env); log "picks: $picks"
  (export $picks; QUANTSERVE_HOME=/tmp/qs-new decode $(left 160) 8b-b1-new --models 8b --quants int8,int4 \
      --kernels triton --batches 1)
  site=/tmp/site-base:$site QUANTSERVE_HOME=/tmp/qs-base decode $(left 310) 8b-b1-base --models 8b \
      --quants int8,int4 --kernels triton --batches 1
  (export $picks; QUANTSERVE_HOME=/tmp/qs-new decode $(left 380) 8b-b1-new-fp16 --models 8b --quants none \
      --kernels triton --batches 1)
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt 450 ]; do sleep 2; done
  tail -n 4 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  [ "$SECONDS" -gt 470 ] || (export $picks; QUANTSERVE_HOME=/tmp/qs-new decode $(left 585) 8b-b1-new-2 --models 8b \
      --quants int8,int4 --kernels triton --batches 1)
else
  echo "attention_gpu.sh: unknown phase '$phase' (1 or 2)" >&2; exit 2
fi
# at most 8 files come back from the machine: the logs' lines that matter are in bench.txt already
rm -f "$out"/split-*.log "$out"/decode-*.log "$out/tests.log"
cat "$out/bench.txt"
