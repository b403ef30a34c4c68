#!/usr/bin/env bash
# What structured output costs on a GPU: one fast-engine server (int8 weights, T4 profile) on a
# random-weight Llama-3.2-1B-shaped checkpoint (128,256 logits; the default tokenizer's 642 real
# tokens), output tokens/s with free text (ignore_eos) against a JSON schema that never completes
# before max_tokens, at concurrency 1 and 32; the two alternate twice on the same server.
#   usage: bench/structured_cost.sh WHEELS_DIR OUT_DIR    (WHEELS_DIR: the quantserve wheel and its
#          serving dependencies, as ../shared/tools/device-wheels.sh fetches them, plus llguidance)
set -euo pipefail
wheels=$(realpath "$1"); out=$(realpath -m "$2"); mkdir -p "$out"
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
export PYTHONPATH=/tmp/site
cd /tmp  # not the source tree: the installed package is the one to run
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) | tee "$out/gpu.txt"
python3 -c "import importlib.metadata as m, torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'llguidance', m.version('llguidance'))" | tee -a "$out/gpu.txt"
python3 -m quantserve.bench.make_checkpoint --shape llama-3.2-1b --shape-vocab --out /tmp/m1b
t0=$(date +%s)
python3 -m quantserve serve /tmp/m1b --engine fast --weight-quant int8 --gpu-profile t4 --max-batch 32 \
    --port 8000 > "$out/server.log" 2>&1 &
server=$!
bench() {  # NAME EXTRA_ARGS...
  name=$1; shift
  python3 -m quantserve.bench.serve --base-url http://127.0.0.1:8000/v1 --concurrency 1,32 --input-len 128 \
      --output-len 128 --out "$out/$name.json" "$@" | tail -n 12 | tee -a "$out/bench.txt"
}
until curl -s -o /dev/null http://127.0.0.1:8000/health; do  # the port opens first, /health says 503 while loading
  kill -0 "$server" 2>/dev/null || { tail -n 20 "$out/server.log"; exit 1; }; sleep 1
done
bench warm-free --ignore-eos --num-prompts 8 --concurrency 1 >/dev/null  # waits while the engine loads
echo "ready after $(( $(date +%s) - t0 )) s" | tee -a "$out/bench.txt"
bench free-1 --ignore-eos
bench json-1 --json-schema fixed-length
bench free-2 --ignore-eos
bench json-2 --json-schema fixed-length
kill "$server"; wait "$server" || true
