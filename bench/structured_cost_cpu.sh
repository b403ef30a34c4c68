#!/usr/bin/env bash
# What structured output costs on this CPU: one hf-engine server on the default model, output
# tokens/s of free text (ignore_eos) against a JSON schema that never completes before max_tokens,
# alternating ROUNDS times on the same server (a 2-core machine's rate drifts by several percent
# from run to run: one pair says little), at concurrency 1 and 32.
#   usage: bench/structured_cost_cpu.sh OUT_DIR [ROUNDS]    (in the virtualenv; nothing else running)
set -euo pipefail
out=$(realpath -m "$1"); rounds=${2:-4}; mkdir -p "$out"
port=${PORT:-8123}
quantserve serve default --engine hf --port "$port" > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
  kill -0 "$server" 2>/dev/null || { tail -n 20 "$out/server.log"; exit 1; }; sleep 1
done
run() {  # NAME EXTRA_ARGS...
  local name=$1; shift
  python -m quantserve.bench.serve --base-url "http://127.0.0.1:$port/v1" --concurrency 1,32 --input-len 32 \
      --output-len 64 --num-prompts 64 --out "$out/$name.json" "$@" > /dev/null
}
run warm --ignore-eos --num-prompts 8 --concurrency 1
for i in $(seq "$rounds"); do
  run "free-$i" --ignore-eos
  run "json-$i" --json-schema fixed-length
done
python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rate(name, c):
    levels = json.load(open(f"{out}/{name}.json"))["runs"]
    return next(l["output_throughput"] for l in levels if l["concurrency"] == c)
for c in (1, 32):
    free = [rate(f"free-{i}", c) for i in range(1, rounds + 1)]
    js = [rate(f"json-{i}", c) for i in range(1, rounds + 1)]
    ratio = statistics.median(js) / statistics.median(free)
    print(f"concurrency {c}: free {', '.join(f'{x:.1f}' for x in free)}; json {', '.join(f'{x:.1f}' for x in js)} tok/s;"
          f" median ratio {ratio:.3f}")
PY
