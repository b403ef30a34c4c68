#!/usr/bin/env bash
# What `--replicas 1` costs: a bare server against the same server behind the replicas' gateway
# (Ray Serve places the replica; requests go gateway -> the replica's own port, never through
# Ray), and against that replica's port directly where `ss` finds it; the same checkpoint and
# engine on the same machine, all up at once and benchmarked in turn (the order changing each
# round), ROUNDS times: output tokens/s and time to first token at concurrency 1 and 8, then the
# table of bench/replicas_compare.py (the median over rounds of each round's ratio to bare).
#   usage: bench/replicas_overhead.sh SITE_DIR OUT_DIR [SERVE_ARGS...]
#   SITE_DIR: quantserve and its serving dependencies installed with pip --target, Ray included
#             (on the lent GPU: the wheels of bench/replicas_wheels.sh, its header says how);
#             '-' runs the quantserve that $PYTHON already imports (a CPU check from a checkout)
#   SERVE_ARGS default to the GPU run's: --weight-quant int8 --gpu-profile t4 --max-batch 32
#   environment (all optional): PYTHON (python3; a path from / when not on PATH: the script runs
#   in /tmp), MODEL (/tmp/m1b, built with
#   bench.make_checkpoint --shape llama-3.2-1b when absent), ROUNDS (3), BARE_PORT (8000),
#   RAY_PORT (8001), BENCH_ARGS (the `bench serve` options after --base-url/--label/--out)
set -euo pipefail
site=$1; out=$(realpath -m "$2"); shift 2; mkdir -p "$out"
[ "$site" = - ] || export PYTHONPATH=$(realpath "$site")
py=${PYTHON:-python3}; model=${MODEL:-/tmp/m1b}; rounds=${ROUNDS:-3}
bare_port=${BARE_PORT:-8000}; ray_port=${RAY_PORT:-8001}
bench_args=${BENCH_ARGS:---concurrency 1,8 --input-len 256 --output-len 128 --ignore-eos --num-prompts 32}
cd /tmp  # not the source tree: the installed package is the one to run
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--weight-quant int8 --gpu-profile t4 --max-batch 32)
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || lscpu | grep -m1 'Model name') \
    | tee "$out/machine.txt"
$py -c "
import importlib.metadata as m
def v(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return 'absent'
print(', '.join(f'{p} {v(p)}' for p in ('torch', 'ray', 'aiohttp', 'uvicorn', 'uvloop', 'httptools', 'quantserve')))" \
    | tee -a "$out/machine.txt"
if [ "$model" = /tmp/m1b ] && [ ! -d /tmp/m1b ]; then
  $py -m quantserve.bench.make_checkpoint --shape llama-3.2-1b --out /tmp/m1b
fi
t0=$(date +%s)
$py -m quantserve serve "$model" --port "$bare_port" "${args[@]}" > "$out/bare.log" 2>&1 &
bare=$!
$py -m quantserve serve "$model" --port "$ray_port" --replicas 1 "${args[@]}" > "$out/ray.log" 2>&1 &
ray=$!
trap 'kill -TERM $bare $ray 2>/dev/null; wait $bare $ray 2>/dev/null || true' EXIT
for port in "$bare_port" "$ray_port"; do
  until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    kill -0 $bare 2>/dev/null && kill -0 $ray 2>/dev/null || { tail -n 30 "$out"/*.log; exit 1; }; sleep 2
  done
  echo "port $port ready after $(( $(date +%s) - t0 )) s" | tee -a "$out/bench.txt"
done
curl -s "http://127.0.0.1:$bare_port/health" | tee "$out/health.json"; echo
bench() {  # NAME PORT SEED: prompts of their own (the gateway and the replica's port share one prefix cache, and a
            # round that re-sent the last one's prompts would time cached prefills)
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of options
  $py -m quantserve.bench.serve --base-url "http://127.0.0.1:$2/v1" $bench_args --seed "$3" --label "$1" --out "$out/$1.json" \
      | tail -n 6 | tee -a "$out/bench.txt"
}
# the replica's own port too, where `ss` can tell it (a local cluster's replica listens on 127.0.0.1):
# what the gateway's hop costs, apart from what living in a Ray actor costs
direct_port=$(ss -ltnp 2>/dev/null | awk '/ServeRepli/ && /127\.0\.0\.1:/ {n = split($4, a, ":"); print a[n]; exit}' || true)
if [ -z "$direct_port" ]; then  # no `ss` (the GPU image has none): the replica process's ports from psutil
  for candidate in $($py -c '
import psutil
for c in psutil.net_connections(kind="tcp"):
    if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1" and c.pid:
        try:
            p = psutil.Process(c.pid)
            if "ServeReplica" in p.name() + " ".join(p.cmdline()):
                print(c.laddr.port)
        except psutil.Error:
            pass' 2>/dev/null); do
    # a Ray worker listens on other ports too (its gRPC server): the replica's is the one serving /health
    if curl -sf -o /dev/null -m 2 "http://127.0.0.1:$candidate/health"; then direct_port=$candidate; break; fi
  done
fi
series=("bare $bare_port" "ray $ray_port")
[ -z "$direct_port" ] || series+=("direct $direct_port")
echo "series: ${series[*]}" | tee -a "$out/bench.txt"
for n in $(seq 1 "$rounds"); do  # the order turns each round: no server always goes first
  for i in $(seq 0 $((${#series[@]} - 1))); do
    read -r name port <<< "${series[$(( (i + n - 1) % ${#series[@]} ))]}"
    bench "$name-$n" "$port" $(( 100 * n + 10 * i ))  # the warm-up request takes seed + 1
  done
done
$py -m quantserve.bench.replicas_compare "$out" | tee "$out/summary.md"
