#!/usr/bin/env bash
# Two builds of quantserve serving the same checkpoint on the lent GPU, one after the other, under
# the same loads: this tree against an older build (a wheel), and this tree with one option
# changed (VARIANT_ARGS), in one call, so that a change's effect is a ratio measured on one
# machine at one time; after the loads, the GPU tests named in GPU_TESTS.
#   usage: bench/ab_serve.sh OLD_WHEEL_DIR OUT   (from the repo root, .devwheels and the wheel dir carried)
#   OLD_WHEEL_DIR: a folder holding the older build's wheel (pip wheel --no-deps of a checkout of
#                  that commit); installed alone in /tmp/site-old, ahead of this tree's /tmp/site
#   environment (optional):
#     GPU_TESTS     pytest -k expression over tests/serve/test_fastcore.py and test_async_scheduling.py
#                   ('' for none)
#     SERVE_ARGS    default: --engine fast --weight-quant int8 --gpu-profile t4 --max-batch 32 --context 2048
#     VARIANT_ARGS  default: --no-async-scheduling ('' for no third server)
#     LIMIT         seconds this script may take (440)
# Loads (bench.serve, 128 tokens out, ignore_eos, streamed): ~685-token random prompts at
# concurrency 1, 8, 32, then 32 clients sharing one ~1,500-token system prompt.  Then, time
# left, bench/quality.py on the default model and the 1B shape (fp16 against int8 KV, int8 and int4
# weights on the GPU).
set -uo pipefail
old=$(realpath "$1"); out=$(realpath -m "$2"); mkdir -p "$out"; repo=$PWD
limit=${LIMIT:-440}
export QUANTSERVE_HOME=/tmp/qs-home QUANTSERVE_TEST_CWD=/tmp PYTHONUNBUFFERED=1
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$out/bench.txt"; }
read -r -a serve_args <<< "${SERVE_ARGS:---engine fast --weight-quant int8 --gpu-profile t4 --max-batch 32 --context 2048}"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/*.whl \
    .devwheels/llama/gguf-*.whl 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/site .devwheels/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site .
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-old "$old"/*.whl
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) | tee "$out/bench.txt"
[ -d /tmp/m1b ] || (cd /tmp && PYTHONPATH=/tmp/site python3 -m quantserve.bench.make_checkpoint \
    --shape llama-3.2-1b --out /tmp/m1b) >> "$out/checkpoint.log" 2>&1
log "installed; checkpoint ready"
serve() {  # LABEL PYTHONPATH PORT [EXTRA ARGS...]: start, wait until ready
  local label=$1 path=$2 port=$3; shift 3
  (cd /tmp && PYTHONPATH=$path exec python3 -m quantserve serve /tmp/m1b --port "$port" "${serve_args[@]}" "$@") \
      > "$out/$label.log" 2>&1 &
  local pid=$! t0=$SECONDS
  until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    kill -0 $pid 2>/dev/null || { log "$label exited"; tail -n 20 "$out/$label.log" | tee -a "$out/bench.txt"; return 1; }
    [ $SECONDS -lt "$limit" ] || { log "$label: out of time"; return 1; }
    sleep 0.5
  done
  log "$label ready after $(( SECONDS - t0 )) s"
  curl -s "http://127.0.0.1:$port/health" > "$out/$label-health.json"
}
load() {  # LABEL PORT
  (cd /tmp && PYTHONPATH=/tmp/site timeout 120 python3 -m quantserve.bench.serve --base-url "http://127.0.0.1:$2/v1" \
      --concurrency 1,8,32 --input-len 225 --output-len 128 --ignore-eos --label "$1" --out "$out/$1-random.json") \
      > "$out/$1-random.log" 2>&1 || log "$1 random: rc=$?"
  tail -n 5 "$out/$1-random.log" >> "$out/bench.txt"
  (cd /tmp && PYTHONPATH=/tmp/site timeout 90 python3 -m quantserve.bench.serve --base-url "http://127.0.0.1:$2/v1" \
      --concurrency 32 --num-prompts 128 --shared-prefix-len 490 --input-len 8 --output-len 128 --ignore-eos \
      --label "$1" --out "$out/$1-shared.json") > "$out/$1-shared.log" 2>&1 || log "$1 shared: rc=$?"
  tail -n 3 "$out/$1-shared.log" >> "$out/bench.txt"
}
# all start together (their compiles share the CPUs), then each is loaded alone; the third is this
# tree again with VARIANT_ARGS (default --no-async-scheduling; '' for none): one change apart
variant=${VARIANT_ARGS---no-async-scheduling}
serve new /tmp/site 8000 & waits=($!)
sleep 1
serve old /tmp/site-old:/tmp/site 8001 & waits+=($!)
if [ -n "$variant" ]; then
  sleep 1
  read -r -a variant_args <<< "$variant"
  serve variant /tmp/site 8002 "${variant_args[@]}" & waits+=($!)
fi
wait "${waits[@]}"
pids=()
for name_port in new:8000 old:8001 variant:8002; do
  pid=$(pgrep -f "m1b --port ${name_port#*:}" | head -n 1)
  [ -n "$pid" ] || continue
  pids+=("$pid")
  load "${name_port%:*}" "${name_port#*:}"
done
kill "${pids[@]}" 2>/dev/null
# the GPU tests after the loads, not beside them: two processes on one GPU are time-sliced, and a
# latency-bound batch-1 step loaded beside the tests came out 2.2x slower (2026-12-04)
gpu_tests=${GPU_TESTS-compiled_cuda or graphs_match or launched_ahead_give}
if [ -n "$gpu_tests" ]; then
  (cd /tmp && PYTHONPATH=/tmp/site timeout $(( limit - SECONDS > 30 ? limit - SECONDS : 30 )) python3 -m pytest \
      --import-mode=append -rA -q -p no:cacheprovider "$repo/tests/serve/test_fastcore.py" \
      "$repo/tests/serve/test_async_scheduling.py" -k "$gpu_tests") > "$out/gpu-tests.log" 2>&1 || log "gpu tests: rc=$?"
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$out/gpu-tests.log" >> "$out/bench.txt"
fi
if [ $SECONDS -lt $(( limit - 100 )) ]; then  # what an int8 KV cache and int8 / int4 weights cost on the GPU
  for shape in default 1b; do
    for what in "--kv int8" "--weights int8" "--weights int4"; do
      arg=($what); [ $shape = default ] || arg+=(--shape $shape)
      [ $SECONDS -lt $(( limit - 30 )) ] || break
      (cd /tmp && PYTHONPATH=/tmp/site timeout $(( limit - SECONDS - 5 )) python3 -m quantserve.bench.quality "${arg[@]}") \
          > "$out/quality-$shape-${what// /}.txt" 2>&1 || log "quality $shape $what: rc=$?"
      tail -n 14 "$out/quality-$shape-${what// /}.txt" >> "$out/bench.txt"
    done
  done
fi
log "done"
