#!/usr/bin/env bash
# What Ray Serve's hops cost: one bare server against `--replicas 1` (the gateway, then one
# replica) with streamed events gathered for 10 ms (the default) and sent one by one (0 ms), the
# same checkpoint and engine on the same GPU, all up at once and benchmarked in turn, twice: time
# to first token and output tokens/s at concurrency 1 and 8.
#   usage: bench/replicas_overhead.sh SITE_DIR OUT_DIR [SERVE_ARGS...]
#   (SITE_DIR: quantserve and its serving dependencies installed with pip --target, Ray included)
set -euo pipefail
site=$(realpath "$1"); out=$(realpath -m "$2"); shift 2; mkdir -p "$out"
export PYTHONPATH=$site
cd /tmp  # not the source tree: the installed package is the one to run
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--weight-quant int8 --gpu-profile t4 --max-batch 32)
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) | tee "$out/gpu.txt"
python3 -c "import importlib.metadata as m, torch; print('torch', torch.__version__, 'ray', m.version('ray'))" | tee -a "$out/gpu.txt"
[ -d /tmp/m1b ] || python3 -m quantserve.bench.make_checkpoint --shape llama-3.2-1b --out /tmp/m1b
t0=$(date +%s)
python3 -m quantserve serve /tmp/m1b --port 8000 "${args[@]}" > "$out/bare.log" 2>&1 &
bare=$!
python3 -m quantserve serve /tmp/m1b --port 8001 --replicas 1 "${args[@]}" > "$out/ray.log" 2>&1 &
ray=$!
python3 -m quantserve serve /tmp/m1b --port 8002 --replicas 1 --stream-interval-ms 0 "${args[@]}" \
    > "$out/ray0.log" 2>&1 &
ray0=$!
for port in 8000 8001 8002; do
  until curl -sf -o /dev/null http://127.0.0.1:$port/health; do
    kill -0 $bare 2>/dev/null && kill -0 $ray 2>/dev/null && kill -0 $ray0 2>/dev/null || { tail -n 30 "$out"/*.log; exit 1; }; sleep 2
  done
  echo "port $port ready after $(( $(date +%s) - t0 )) s" | tee -a "$out/bench.txt"
done
curl -s http://127.0.0.1:8000/health | tee "$out/health.json"; echo
bench() {  # NAME PORT
  python3 -m quantserve.bench.serve --base-url http://127.0.0.1:$2/v1 --concurrency 1,8 --input-len 256 \
      --output-len 128 --ignore-eos --num-prompts 32 --label "$1" --out "$out/$1.json" | tail -n 6 | tee -a "$out/bench.txt"
}
bench bare-1 8000; bench ray10-1 8001; bench ray0-1 8002; bench bare-2 8000; bench ray10-2 8001; bench ray0-2 8002
kill -TERM $bare $ray $ray0; wait $bare $ray $ray0 || true
