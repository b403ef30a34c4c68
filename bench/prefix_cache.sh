#!/usr/bin/env bash
# The prefix cache on the lent GPU: ours with it, ours without it (--no-prefix-cache) and
# llama.cpp's own llama-server on the Q8_0 GGUF of the same random-weight checkpoint, one at a
# time on the same GPU.  Loads: 32 clients sharing one ~1,500-token system text (490 words) with distinct
# 8-word questions (128 requests, 128 tokens out), and random ~690-token prompts (225 words) at concurrency
# 1 and 32.  Also time to ready: ours with an empty compile cache, then with the cache warm.
#   usage: bench/prefix_cache.sh SITE_DIR OUT_DIR SHAPE [LLAMA_BIN_DIR]
#   (SITE_DIR: quantserve and its serving dependencies installed with pip --target; without
#    LLAMA_BIN_DIR only ours is measured.  RUNS="ours-cache" picks runs; KEEP_COMPILE_CACHE=1 keeps
#    the compile cache of an earlier call instead of starting cold)
set -euo pipefail
site=$(realpath "$1"); out=$(realpath -m "$2"); shape=$3; llama=${4:-}; mkdir -p "$out"
export PYTHONPATH=$site QUANTSERVE_HOME=/tmp/qs-home
cd /tmp  # not the source tree: the installed package is the one to run
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
ck=/tmp/ck-$shape; gg=/tmp/gguf-$shape
[ -d "$ck" ] || python3 -m quantserve.bench.make_checkpoint --shape "$shape" --out "$ck" --context 4096
[ -d "$gg" ] || python3 -m quantserve convert "$ck" -f gguf-q8_0 -o "$gg" -q
ours=(--engine fast --weight-quant int8 --gpu-profile t4 --max-batch 32 --context 2048)

wait_ready() {  # PORT PID LABEL: seconds from launch to a 200 on /health
  local t0=$SECONDS
  until curl -sf -o /dev/null "http://127.0.0.1:$1/health"; do
    kill -0 "$2" 2>/dev/null || { tail -n 40 "$out/$3.log"; exit 1; }; sleep 1
  done
  echo "$3: ready after $(( SECONDS - t0 )) s" | tee -a "$out/bench.txt"
  curl -s "http://127.0.0.1:$1/health" | tee -a "$out/bench.txt" || true; echo >> "$out/bench.txt"
}
shared() {  # LABEL PORT
  python3 -m quantserve.bench.serve --base-url "http://127.0.0.1:$2/v1" --concurrency 32 --num-prompts 128 \
      --shared-prefix-len 490 --input-len 8 --output-len 128 --ignore-eos --label "$1" \
      --out "$out/$1-shared.json" | tail -n 8 | tee -a "$out/bench.txt"
}
random_load() {  # LABEL PORT
  python3 -m quantserve.bench.serve --base-url "http://127.0.0.1:$2/v1" --concurrency 1,32 --input-len 225 \
      --output-len 128 --ignore-eos --label "$1" --out "$out/$1-random.json" | tail -n 8 | tee -a "$out/bench.txt"
}
run_ours() {  # LABEL EXTRA_ARGS...
  local label=$1; shift
  python3 -m quantserve serve "$ck" --port 8000 "${ours[@]}" "$@" > "$out/$label.log" 2>&1 &
  local pid=$!
  wait_ready 8000 $pid "$label"
  shared "$label" 8000
  [ "$label" != ours-cache ] || random_load "$label" 8000
  kill -TERM $pid; wait $pid || true
}

runs=${RUNS:-ours-cache ours-nocache llama-server}
[ -n "${KEEP_COMPILE_CACHE:-}" ] || rm -rf "$QUANTSERVE_HOME/compile"
[[ " $runs " != *" ours-cache "* ]] || run_ours ours-cache                      # cold: nothing compiled yet
[[ " $runs " != *" ours-nocache "* ]] || run_ours ours-nocache --no-prefix-cache  # warm: the run before's cache
if [ -n "$llama" ] && [[ " $runs " == *" llama-server "* ]]; then
  "$llama/llama-server" -m "$(ls "$gg"/*.gguf)" -ngl 999 -np 32 -c $((32 * 2048)) -fa on \
      --host 127.0.0.1 --port 8001 > "$out/llama-server.log" 2>&1 &
  pid=$!
  wait_ready 8001 $pid llama-server
  shared llama-server 8001
  random_load llama-server 8001
  kill -TERM $pid; wait $pid || true
fi
