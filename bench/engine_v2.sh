#!/usr/bin/env bash
# The paged engine on the lent GPU against llama.cpp's own llama-server, in back-to-back calls (the
# machine stays warm between them and keeps /tmp).  Random-weight Llama checkpoints of the 1B and
# 8B shapes with the default tokenizer; ours: --engine fast --weight-quant int8 --gpu-profile t4;
# theirs: llama-server on the Q8_0 GGUF of the same checkpoint, -np 32, flash attention.
#   bench/engine_v2.sh OUT 1   install; llama.cpp's build and the checkpoints start detached; ours 1B:
#                              start-up cold, ~690-token prompts at concurrency 1, 8, 32 and the
#                              shared prefix; warm starts with --no-async-scheduling (random) and
#                              --no-prefix-cache (shared); llama-server 1B the same (GPU_TESTS=1:
#                              the engine's GPU tests first)
#   bench/engine_v2.sh OUT 2   8B, ours: start-up cold, random prompts and the shared prefix (on a
#                              fresh machine: phase 1's setup first, for the 8B shape only)
#   bench/engine_v2.sh OUT 3   8B: llama-server, random prompts and the shared prefix; ours warm
#                              starts with --no-async-scheduling (random), --no-prefix-cache (shared)
#   bench/engine_v2.sh OUT 4   ours alone, 1B: the attention kernel's GPU test, start-up cold and
#                              warm, random prompts at 1, 8, 32 with py-spy on the server at 1
#                              (.devwheels/tools carries py-spy's wheel)
#   bench/engine_v2.sh OUT 6   ours alone (a fresh machine, no llama.cpp build beside it): 1B cold
#                              start, random and shared loads with py-spy on the server, warm start;
#                              8B cold and warm starts (each start-up part by part in the logs)
#   bench/engine_v2.sh OUT 7   ours alone, 8B, a fresh machine: cold start, random prompts, warm start
#   bench/engine_v2.sh OUT 5   capacity at --context 8192 with fp16 and int8 KV; int8 KV's quality, 1B
#   bench/engine_v2.sh OUT 8   a fresh machine split in two: llama.cpp's build and the checkpoints on
#                              cores 8-15, ours (server and client) on cores 0-7 throughout.  1B: ours
#                              cold (random, shared), warm with --no-prefix-cache (shared), a warm start;
#                              the engine's GPU tests; llama-server 1B once built
#   bench/engine_v2.sh OUT 10  a fresh machine, ours alone on cores 0-7, 1B: tokenization batched off the
#                              loop (the default on 8 cores) against on the loop (QUANTSERVE_OFF_LOOP_CHARS):
#                              random and shared loads each, the shared load without the prefix cache,
#                              the loop probe both ways
#   bench/engine_v2.sh OUT 11  a fresh machine, ours alone on all cores, 8B: cold start, random prompts at
#                              1, 8, 32 and the shared load (bench serve's aiohttp client), warm start with
#                              --no-prefix-cache (shared); each shared load again with --client httpx
#   bench/engine_v2.sh OUT 9   the same machine: the event loop's tokenization probe on cores 0-7;
#                              llama-server 1B if phase 8 had no time for it; 8B: ours cold (random,
#                              shared), warm --no-prefix-cache (shared); llama-server 8B (random, shared)
#   bench/engine_v2.sh OUT 12  a fresh machine, ours alone, 8B: start-up cold and warm of this tree against
#                              a base (the files under .devwheels/base laid over this tree's install), py-spy
#                              on this tree's cold start; random prompts at 1, 8, 32 and the shared load with
#                              and without the prefix cache (.devwheels/tools carries py-spy's wheel; a
#                              carried .rayw/ray is copied to /tmp/qs-ray for bench/replicas_wheels.sh's run)
#   bench/engine_v2.sh OUT 13  a fresh machine, ours alone, 8B: cold start; the shared load with py-spy on
#                              the server through its first wave (every thread, idle ones too, 200 Hz,
#                              8 s) and the engine's split around it; warm starts with the rotary tables'
#                              cache removed, then kept (the difference is their import)
#   bench/engine_v2.sh OUT 14  ours alone, 8B (a machine phase 13 left warm, or a fresh one): the shared load
#                              on a fresh server with the prefix cache, then without, twice over
#   bench/engine_v2.sh OUT 15  a fresh machine, 8B, one call: llama.cpp's build detached (carry .devllama too);
#                              ours cold (shared, random), warm --no-prefix-cache (shared), warm (shared); then
#                              llama-server on the Q8_0 GGUF (shared, random)
#   bench/engine_v2.sh OUT 17  a fresh machine, ours alone, 1B: the shared load on a first start
#   bench/engine_v2.sh OUT 18  a fresh machine, ours alone, 8B: cold start, random and shared loads; a warm start
#                              under py-spy from launch; then this tree against a base (.devwheels/base: the
#                              token buckets of powers of two only, no gc freeze), each warm: idle prompts and
#                              the shared load; 1B: the shared load on a first start, and on the base; every
#                              server with bench/gcwatch on its path (full collections into its log);
#                              FULL=0 leaves out the py-spy start and the 1B shape (~6 min)
#   bench/engine_v2.sh OUT 19  phase 18's machine kept warm after bench/fusion_gpu.sh (llama.cpp built, the 8B's
#                              Q8_0 GGUF): ours warm without and with the prefix cache, llama-server: idle, shared
#   bench/engine_v2.sh OUT 16  phase 15's machine kept warm, 1B: llama-server (shared, random; httpx client), ours
#                              first start (shared, random), warm --no-prefix-cache (shared)
# Run from the repo root with .devwheels carried (the wheels the GPU image lacks).
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site QUANTSERVE_HOME=/tmp/qs-home QUANTSERVE_TEST_CWD=/tmp QUANTSERVE_TEST_START_TIMEOUT=300
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$out/bench.txt"; }
ours=(--engine fast --weight-quant int8 --gpu-profile t4 --max-batch 32 --context 2048)
ours+=(${OURS_EXTRA:-})  # e.g. OURS_EXTRA="--kv-blocks 3000"

wait_ready() {  # PORT PID LABEL: seconds from launch to a 200 on /health
  local t0=$SECONDS
  until curl -sf -o /dev/null "http://127.0.0.1:$1/health"; do
    kill -0 "$2" 2>/dev/null || { log "$3 exited"; tail -n 30 "$out/$3.log" | tee -a "$out/bench.txt"; return 1; }
    sleep 0.5
  done
  log "$3: ready after $(( SECONDS - t0 )) s"
  curl -s "http://127.0.0.1:$1/health" >> "$out/bench.txt"; echo >> "$out/bench.txt"
}
load() {  # LABEL PORT KIND: random ~690-token prompts at 1, 8, 32; or the shared ~1,500-token system text
  local label=$1 port=$2 kind=$3 args
  case $kind in
    random) args=(--concurrency 1,8,32 --input-len 225) ;;
    idle) args=(--concurrency 1 --num-prompts 24 --input-len 225) ;;
    shared) args=(--concurrency 32 --num-prompts 128 --shared-prefix-len 490 --input-len 8 --save-records) ;;
  esac
  (cd /tmp && timeout 240 ${PIN:+taskset -c $PIN} python3 -m quantserve.bench.serve --base-url "http://127.0.0.1:$port/v1" "${args[@]}" \
      --output-len 128 --ignore-eos --label "$label" --out "$out/$label-$kind.json" ${SERVE_EXTRA:-}) \
      > "$out/$label-$kind.log" 2>&1 \
      || log "$label $kind: rc=$?"
  tail -n 6 "$out/$label-$kind.log" >> "$out/bench.txt"
}
start_ours() {  # LABEL CHECKPOINT ARGS...: our server on :8000 (sets PID; on the cores $PIN names, if set)
  local label=$1 ck=$2; shift 2
  (cd /tmp && exec ${PIN:+taskset -c $PIN} python3 -m quantserve serve "$ck" --port 8000 "$@") > "$out/$label.log" 2>&1 &
  PID=$!
  wait_ready 8000 $PID "$label"
}
start_llama() {  # LABEL GGUF
  /tmp/llama-cpp/bin/llama-server -m "$2" -ngl 999 -np 32 -c $((32 * 2048)) -fa on --host 127.0.0.1 \
      --port 8001 > "$out/$1.log" 2>&1 &
  PID=$!
  wait_ready 8001 $PID "$1"
}
stop() { kill -TERM "$PID" 2>/dev/null; wait "$PID" 2>/dev/null || true; }
engine_ttft() {  # LABEL PORT: the time-to-first-token histograms' sums and counts (ours), with the
                 # preemption and prefix-cache counters, for differences
  curl -s "http://127.0.0.1:$2/metrics" | grep -E "^quantserve:((request_queue_time|request_prefill_time|time_to_first_token)_seconds_(sum|count)|num_preemptions|prefix_cache_(queries|hits))" \
      | sed "s/^/$1 /" >> "$out/engine-ttft.txt"
}
shared_split() {  # LABEL: the shared load with the server's own split of its time to first token around it
  engine_ttft "$1-before" 8000; load "$1" 8000 shared; engine_ttft "$1-after" 8000
}
machine() {  # the GPU, the driver and the libraries, into bench.txt
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) | tee -a "$out/bench.txt"
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" \
      | tee -a "$out/bench.txt"
  # uvicorn's HTTP parser: h11 (pure Python) where httptools is missing, which slows the HTTP layer
  python3 -c "import importlib.util as u; print('uvicorn http:', 'httptools' if u.find_spec('httptools') else 'h11', '| loop:', 'uvloop' if u.find_spec('uvloop') else 'asyncio')" \
      | tee -a "$out/bench.txt"
}
finish() {  # the start-up lines and the time-to-first-token split into bench.txt, everything in one
            # tarball (the device sends back at most 8 files), then stop
  grep -h "loaded fast engine" "$out"/ours-*.log >> "$out/bench.txt" 2>/dev/null
  cat "$out/engine-ttft.txt" >> "$out/bench.txt" 2>/dev/null
  (cd "$out" && tar czf results.tgz *.json *.log *.txt 2>/dev/null)
  log "phase $phase done"; exit 0
}
checkpoint() {  # SHAPE [ready]: wait for the detached job's checkpoint and GGUF (ready: the checkpoint)
  for i in $(seq 300); do [ -f "/tmp/ck-$1.${2:-done}" ] && return 0; sleep 2; done; log "no checkpoint $1"; return 1
}
capacity() {  # LABEL ARGS...: 64 concurrent ~1,200-token prompts at --context 8192; most running at once
  start_ours "$1" /tmp/ck-llama-3.1-8b --engine fast --weight-quant int8 --gpu-profile t4 --max-batch 64 \
      --context 8192 "${@:2}" || return
  (cd /tmp && bash "$repo/bench/capacity_load.sh" "$out" "$1" 200)
  stop
}

install() {
  [ -d "$site/fastapi" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      .devwheels/*.whl .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
  # this tree's quantserve every time: a warm machine keeps the last call's
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" .
}

if [ "$phase" = 6 ]; then  # start-up, part by part, and a profile of the server under load: ours alone
  install
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools .devwheels/tools/*.whl
  machine
  setsid nohup bash -c "cd /tmp && for s in llama-3.2-1b llama-3.1-8b; do python3 -m quantserve.bench.make_checkpoint \
      --shape \$s --out /tmp/ck-\$s --context 8192 && touch /tmp/ck-\$s.ready; done" > /tmp/checkpoints.log 2>&1 < /dev/null &
  checkpoint llama-3.2-1b ready
  rm -rf "$QUANTSERVE_HOME/compile"
  if start_ours ours-1b-cold /tmp/ck-llama-3.2-1b "${ours[@]}"; then
    /tmp/tools/bin/py-spy record -p "$PID" -d 12 -r 200 -f raw --threads -o "$out/pyspy-1b-load.txt" > /dev/null 2>&1 &
    load ours-1b 8000 random; load ours-1b 8000 shared; stop
  fi
  start_ours ours-1b-warm /tmp/ck-llama-3.2-1b "${ours[@]}" && stop
  checkpoint llama-3.1-8b ready
  rm -rf "$QUANTSERVE_HOME/compile"
  start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  start_ours ours-8b-warm /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  finish
fi

if [ "$phase" = 7 ]; then  # 8B alone on a fresh machine: cold start, random prompts, warm start
  install
  machine
  (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.1-8b --out /tmp/ck-llama-3.1-8b \
      --context 8192 > /tmp/checkpoints.log 2>&1) || { log "no checkpoint"; exit 1; }
  start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}" && { load ours-8b 8000 random; stop; }
  start_ours ours-8b-warm /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  finish
fi

if [ "$phase" = 12 ]; then
  install
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools .devwheels/tools/*.whl
  [ -d .rayw/ray ] && { mkdir -p /tmp/qs-ray && cp .rayw/ray/*.whl /tmp/qs-ray/; }
  rm -rf /tmp/site-base && cp -r "$site" /tmp/site-base && cp -r .devwheels/base/. /tmp/site-base/
  machine
  (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.1-8b --out /tmp/ck-llama-3.1-8b \
      --context 8192 > /tmp/checkpoints.log 2>&1) || { log "no checkpoint"; exit 1; }
  rm -rf "$QUANTSERVE_HOME/compile"
  PYTHONPATH=/tmp/site-base start_ours ours-8b-base-cold /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  rm -rf "$QUANTSERVE_HOME/compile"
  (cd /tmp && exec python3 -m quantserve serve /tmp/ck-llama-3.1-8b --port 8000 "${ours[@]}") > "$out/ours-8b-cold.log" 2>&1 &
  PID=$!
  /tmp/tools/bin/py-spy record -p "$PID" -d 110 -r 50 --idle --threads -f raw -o "$out/pyspy-8b-cold.txt" > /dev/null 2>&1 &
  if wait_ready 8000 $PID ours-8b-cold; then load ours-8b 8000 random; shared_split ours-8b; stop; fi
  start_ours ours-8b-nocache /tmp/ck-llama-3.1-8b "${ours[@]}" --no-prefix-cache && { shared_split ours-8b-nocache; stop; }
  start_ours ours-8b-warm /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  PYTHONPATH=/tmp/site-base start_ours ours-8b-base-warm /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  finish
fi

if [ "$phase" = 13 ]; then
  install
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools .devwheels/tools/*.whl
  machine
  (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.1-8b --out /tmp/ck-llama-3.1-8b \
      --context 8192 > /tmp/checkpoints.log 2>&1) || { log "no checkpoint"; exit 1; }
  rm -rf "$QUANTSERVE_HOME/compile" "$QUANTSERVE_HOME/rope"
  if start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}"; then
    /tmp/tools/bin/py-spy record -p "$PID" -d 8 -r 200 --idle --threads -f raw -o "$out/pyspy-8b-shared.txt" \
        > /dev/null 2>&1 &
    shared_split ours-8b; load ours-8b 8000 random; stop
  fi
  rm -rf "$QUANTSERVE_HOME/rope"
  start_ours ours-8b-warm-norope /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  start_ours ours-8b-warm /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  finish
fi

if [ "$phase" = 14 ]; then
  install
  machine
  [ -f /tmp/checkpoints.log ] || (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.1-8b \
      --out /tmp/ck-llama-3.1-8b --context 8192 > /tmp/checkpoints.log 2>&1) || { log "no checkpoint"; exit 1; }
  for i in 1 2; do
    start_ours ours-8b-cache$i /tmp/ck-llama-3.1-8b "${ours[@]}" && { shared_split ours-8b-cache$i; stop; }
    start_ours ours-8b-nocache$i /tmp/ck-llama-3.1-8b "${ours[@]}" --no-prefix-cache && { shared_split ours-8b-nocache$i; stop; }
  done
  finish
fi

if [ "$phase" = 15 ]; then
  install
  machine
  setsid nohup nice -n 19 taskset -c 8-15 bash .devwheels/device-llama-cpp.sh .devllama/llama_cpp_python-0.3.36.tar.gz \
      /tmp/llama-cpp 90 > /tmp/llama-build.out 2>&1 < /dev/null &
  (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.1-8b --out /tmp/ck-llama-3.1-8b \
      --context 8192 > /tmp/checkpoints.log 2>&1) || { log "no checkpoint"; exit 1; }
  rm -rf "$QUANTSERVE_HOME/compile"
  start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}" && { shared_split ours-8b; load ours-8b 8000 random; stop; }
  start_ours ours-8b-nocache /tmp/ck-llama-3.1-8b "${ours[@]}" --no-prefix-cache && { shared_split ours-8b-nocache; stop; }
  (cd /tmp && python3 -m quantserve convert /tmp/ck-llama-3.1-8b -f gguf-q8_0 -o /tmp/gguf-llama-3.1-8b -q) \
      >> /tmp/checkpoints.log 2>&1 || log "no GGUF"
  # while llama.cpp compiles: the cached run again, on a warm start (a second sample)
  start_ours ours-8b-warm /tmp/ck-llama-3.1-8b "${ours[@]}" && { shared_split ours-8b-warm; stop; }
  for i in $(seq 400); do [ -x /tmp/llama-cpp/bin/llama-server ] && break; sleep 1; done
  log "llama.cpp's build: $([ -x /tmp/llama-cpp/bin/llama-server ] && echo ready || echo 'not ready')"
  start_llama llama-8b /tmp/gguf-llama-3.1-8b/*.gguf && { load llama-8b 8001 shared; load llama-8b 8001 random; stop; }
  finish
fi

if [ "$phase" = 16 ]; then  # phase 15's machine kept warm (llama.cpp built): the 1B shape, both servers
  [ -x /tmp/llama-cpp/bin/llama-server ] || { log "phase 16 needs phase 15's llama.cpp build in /tmp"; exit 3; }
  install
  machine
  (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.2-1b --out /tmp/ck-llama-3.2-1b \
      --context 8192 && python3 -m quantserve convert /tmp/ck-llama-3.2-1b -f gguf-q8_0 -o /tmp/gguf-llama-3.2-1b -q) \
      > /tmp/checkpoints-1b.log 2>&1 || { log "no checkpoint"; exit 1; }
  # httpx for llama-server: under aiohttp it dropped a few kept-alive connections (phase 15)
  start_llama llama-1b /tmp/gguf-llama-3.2-1b/*.gguf && {
    SERVE_EXTRA="--client httpx" load llama-1b 8001 shared; SERVE_EXTRA="--client httpx" load llama-1b 8001 random; stop; }
  start_ours ours-1b-cold /tmp/ck-llama-3.2-1b "${ours[@]}" && { shared_split ours-1b; load ours-1b 8000 random; stop; }
  start_ours ours-1b-nocache /tmp/ck-llama-3.2-1b "${ours[@]}" --no-prefix-cache && { shared_split ours-1b-nocache; stop; }
  finish
fi

if [ "$phase" = 17 ]; then  # a fresh machine, ours alone, 1B: the shared load on a first start (gc frozen)
  install
  machine
  (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.2-1b --out /tmp/ck-llama-3.2-1b \
      --context 8192 > /tmp/checkpoints-1b.log 2>&1) || { log "no checkpoint"; exit 1; }
  start_ours ours-1b-cold /tmp/ck-llama-3.2-1b "${ours[@]}" && { shared_split ours-1b; stop; }
  finish
fi

if [ "$phase" = 18 ]; then
  install
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools .devwheels/tools/*.whl
  rm -rf /tmp/site-base && cp -r "$site" /tmp/site-base && cp -r .devwheels/base/. /tmp/site-base/
  machine
  export PYTHONPATH=$repo/bench/gcwatch:$site
  (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.1-8b --out /tmp/ck-llama-3.1-8b \
      --context 8192 > /tmp/checkpoints.log 2>&1) || { log "no checkpoint"; exit 1; }
  rm -rf "$QUANTSERVE_HOME/compile"
  start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}" && { load ours-8b 8000 random; shared_split ours-8b; stop; }
  # a warm start under py-spy from launch (every thread, idle ones too), stopped once ready (FULL=0: left out)
  if [ "${FULL:-1}" = 1 ]; then
    (cd /tmp && exec /tmp/tools/bin/py-spy record -r 100 --idle --threads -f raw -o "$out/pyspy-8b-warm.txt" -- \
        python3 -m quantserve serve /tmp/ck-llama-3.1-8b --port 8000 "${ours[@]}") > "$out/ours-8b-warm-pyspy.log" 2>&1 &
    PID=$!
    wait_ready 8000 $PID ours-8b-warm-pyspy; kill -TERM $(pgrep -P $PID) 2>/dev/null; wait $PID 2>/dev/null
  fi
  start_ours ours-8b-warm /tmp/ck-llama-3.1-8b "${ours[@]}" && { load ours-8b-warm 8000 idle; shared_split ours-8b-warm; stop; }
  PYTHONPATH=$repo/bench/gcwatch:/tmp/site-base start_ours ours-8b-base /tmp/ck-llama-3.1-8b "${ours[@]}" \
      && { load ours-8b-base 8000 idle; shared_split ours-8b-base; stop; }
  if [ "${FULL:-1}" = 1 ]; then  # FULL=0: the 8B shape only
    (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.2-1b --out /tmp/ck-llama-3.2-1b \
        --context 8192 > /tmp/checkpoints-1b.log 2>&1) || { log "no checkpoint"; exit 1; }
    start_ours ours-1b-first /tmp/ck-llama-3.2-1b "${ours[@]}" && { shared_split ours-1b-first; load ours-1b 8000 idle; stop; }
    PYTHONPATH=$repo/bench/gcwatch:/tmp/site-base start_ours ours-1b-base /tmp/ck-llama-3.2-1b "${ours[@]}" \
        && { shared_split ours-1b-base; load ours-1b-base 8000 idle; stop; }
  fi
  # collections of 20 ms or more, and how many of each log's were full ones
  grep -H "gcwatch" "$out"/ours-*.log | awk '{for (i = 1; i <= NF; i++) if ($i == "took") ms = $(i + 1); if (ms + 0 >= 20) print}' \
      | tail -n 60 >> "$out/bench.txt"
  grep -c "gcwatch: generation 2" "$out"/ours-*.log >> "$out/bench.txt"
  finish
fi

if [ "$phase" = 19 ]; then  # a machine that ran phase 18 and bench/fusion_gpu.sh (llama.cpp, the 8B's Q8_0 GGUF)
  install; machine
  start_ours ours-8b-nocache /tmp/ck-llama-3.1-8b "${ours[@]}" --no-prefix-cache && { shared_split ours-8b-nocache; stop; }
  start_ours ours-8b-again /tmp/ck-llama-3.1-8b "${ours[@]}" && { load ours-8b-again 8000 idle; shared_split ours-8b-again; stop; }
  start_llama llama-8b /tmp/llama-3.1-8b-Q8_0.gguf && { load llama-8b 8001 idle; load llama-8b 8001 shared; stop; }
  finish
fi

if [ "$phase" = 11 ]; then
  install
  machine
  (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.1-8b --out /tmp/ck-llama-3.1-8b \
      --context 8192 > /tmp/checkpoints.log 2>&1) || { log "no checkpoint"; exit 1; }
  rm -rf "$QUANTSERVE_HOME/compile"
  if start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}"; then
    load ours-8b 8000 random; shared_split ours-8b
    engine_ttft ours-8b-httpx-before 8000; SERVE_EXTRA="--client httpx" load ours-8b-httpx 8000 shared
    engine_ttft ours-8b-httpx-after 8000; stop
  fi
  if start_ours ours-8b-nocache /tmp/ck-llama-3.1-8b "${ours[@]}" --no-prefix-cache; then
    shared_split ours-8b-nocache; SERVE_EXTRA="--client httpx" load ours-8b-nocache-httpx 8000 shared; stop
  fi
  finish
fi

if [ "$phase" = 10 ]; then
  install; export PIN=0-7
  machine
  (cd /tmp && taskset -c 8-15 python3 -m quantserve.bench.make_checkpoint --shape llama-3.2-1b --out /tmp/ck-llama-3.2-1b \
      --context 8192 > /tmp/checkpoints.log 2>&1) || { log "no checkpoint"; exit 1; }
  start_ours ours-1b-cold /tmp/ck-llama-3.2-1b "${ours[@]}" && { load ours-1b 8000 random; shared_split ours-1b; stop; }
  QUANTSERVE_OFF_LOOP_CHARS=1000000000 start_ours ours-1b-onloop /tmp/ck-llama-3.2-1b "${ours[@]}" \
      && { load ours-1b-onloop 8000 random; shared_split ours-1b-onloop; stop; }
  start_ours ours-1b-nocache /tmp/ck-llama-3.2-1b "${ours[@]}" --no-prefix-cache && { shared_split ours-1b-nocache; stop; }
  for where in --on-loop --off-loop; do
    (cd /tmp && CUDA_VISIBLE_DEVICES= timeout 100 taskset -c $PIN python3 "$repo/bench/loop_probe.py" --serve $where 8970 440) \
        >> "$out/loop-probe.txt" 2>&1 || log "loop probe $where: rc=$?"
  done
  cat "$out/loop-probe.txt" >> "$out/bench.txt"
  finish
fi

if [ "$phase" = 8 ] || [ "$phase" = 9 ]; then  # cores 0-7 ours, 8-15 the build and the checkpoints
  install; export PIN=0-7
  if [ "$phase" = 8 ]; then
    machine
    lscpu | grep -E "^Model name|^CPU\(s\)" >> "$out/bench.txt"
    [ -x /tmp/llama-cpp/bin/llama-server ] || setsid nohup taskset -c 8-15 bash .devwheels/device-llama-cpp.sh \
        .devwheels/llama/llama_cpp_python-0.3.36.tar.gz /tmp/llama-cpp 90 > /tmp/llama-build.out 2>&1 < /dev/null &
    setsid nohup taskset -c 8-15 bash -c "cd /tmp && for s in llama-3.2-1b llama-3.1-8b; do [ -f /tmp/ck-\$s.done ] || { \
        python3 -m quantserve.bench.make_checkpoint --shape \$s --out /tmp/ck-\$s --context 8192 && touch /tmp/ck-\$s.ready && \
        python3 -m quantserve convert /tmp/ck-\$s -f gguf-q8_0 -o /tmp/gguf-\$s -q && touch /tmp/ck-\$s.done; }; done" \
        > /tmp/checkpoints.log 2>&1 < /dev/null &
    checkpoint llama-3.2-1b ready
    rm -rf "$QUANTSERVE_HOME/compile"
    start_ours ours-1b-cold /tmp/ck-llama-3.2-1b "${ours[@]}" && { load ours-1b 8000 random; shared_split ours-1b; stop; }
    start_ours ours-1b-nocache /tmp/ck-llama-3.2-1b "${ours[@]}" --no-prefix-cache && { shared_split ours-1b-nocache; stop; }
    start_ours ours-1b-warm /tmp/ck-llama-3.2-1b "${ours[@]}" && stop
    # while llama.cpp builds: async scheduling and the compiled steps on the GPU against eager
    (cd /tmp && timeout $(( 480 - SECONDS > 60 ? 480 - SECONDS : 60 )) taskset -c $PIN python3 -m pytest --import-mode=append -rA -q \
        -p no:cacheprovider "$repo/tests/serve/test_async_scheduling.py" "$repo/tests/serve/test_fastcore.py" \
        -k "launched_ahead or preemption or sampled_requests or compiled_cuda or graphs_match") > "$out/gpu-tests.log" 2>&1 \
        || log "gpu tests: rc=$?"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu-tests.log" >> "$out/bench.txt"
  else
    [ -f /tmp/checkpoints.log ] || { log "phase 9 needs phase 8's machine: this one is fresh"; exit 3; }
    # the event loop under bursts of 32 prompts, tokenized on and off it (the default model, hf engine)
    for words in 440 1200; do for where in --on-loop --off-loop; do
      (cd /tmp && CUDA_VISIBLE_DEVICES= timeout 120 taskset -c $PIN python3 "$repo/bench/loop_probe.py" --serve $where 8970 $words) \
          >> "$out/loop-probe.txt" 2>&1 || log "loop probe $words $where: rc=$?"
    done; done
    cat "$out/loop-probe.txt" >> "$out/bench.txt"
  fi
  if [ ! -f /tmp/llama-1b.done ]; then
    for i in $(seq 150); do [ -x /tmp/llama-cpp/bin/llama-server ] && break; [ $SECONDS -gt 520 ] && break; sleep 2; done
    if [ -x /tmp/llama-cpp/bin/llama-server ] && [ -f /tmp/ck-llama-3.2-1b.done ]; then
      tail -n 3 /tmp/llama-build.out >> "$out/bench.txt"
      start_llama llama-1b /tmp/gguf-llama-3.2-1b/*.gguf && { load llama-1b 8001 random; load llama-1b 8001 shared; stop; }
      touch /tmp/llama-1b.done
    else
      log "llama.cpp's build (or the 1B GGUF) not ready: llama-server 1B left to phase 9"
    fi
  fi
  if [ "$phase" = 9 ]; then
    checkpoint llama-3.1-8b ready
    rm -rf "$QUANTSERVE_HOME/compile"
    start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}" && { load ours-8b 8000 random; shared_split ours-8b; stop; }
    start_ours ours-8b-nocache /tmp/ck-llama-3.1-8b "${ours[@]}" --no-prefix-cache && { shared_split ours-8b-nocache; stop; }
    checkpoint llama-3.1-8b
    start_llama llama-8b /tmp/gguf-llama-3.1-8b/*.gguf && { load llama-8b 8001 random; load llama-8b 8001 shared; stop; }
  fi
  finish
fi

if [ "$phase" = 4 ]; then
  install
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools .devwheels/tools/*.whl
  machine
  setsid nohup bash -c "cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.2-1b \
      --out /tmp/ck-llama-3.2-1b --context 8192 && touch /tmp/ck-llama-3.2-1b.done" > /tmp/checkpoints.log 2>&1 < /dev/null &
  (cd /tmp && timeout 120 python3 -m pytest --import-mode=append -q -p no:cacheprovider \
      "$repo/tests/serve/test_paged_attention.py") > "$out/gpu-tests.log" 2>&1 || log "gpu tests: rc=$?"
  tail -n 2 "$out/gpu-tests.log" >> "$out/bench.txt"
  checkpoint llama-3.2-1b
  rm -rf "$QUANTSERVE_HOME/compile"
  if start_ours ours-1b-cold /tmp/ck-llama-3.2-1b "${ours[@]}"; then
    /tmp/tools/bin/py-spy record -p "$PID" -d 20 -r 250 -f raw --threads -o "$out/pyspy-c1.txt" > /dev/null 2>&1 &
    load ours-1b 8000 random
    stop
  fi
  start_ours ours-1b-warm /tmp/ck-llama-3.2-1b "${ours[@]}" && stop
  log "phase 4 done"; exit 0
fi

install  # every phase: a warm machine keeps the last call's quantserve
if [ "$phase" = 1 ] || { [ "$phase" = 2 ] && [ ! -f /tmp/checkpoints.log ]; }; then
  # a fresh machine: llama.cpp's build and the checkpoints (with their Q8_0 GGUFs), detached
  machine
  [ -x /tmp/llama-cpp/bin/llama-server ] || setsid nohup nice -n 19 bash .devwheels/device-llama-cpp.sh \
      .devwheels/llama/llama_cpp_python-0.3.36.tar.gz /tmp/llama-cpp 90 > /tmp/llama-build.out 2>&1 < /dev/null &
  shapes="llama-3.2-1b llama-3.1-8b"; [ "$phase" = 2 ] && shapes=llama-3.1-8b
  # ck-SHAPE.ready: the checkpoint (ours can start); ck-SHAPE.done: its GGUF too (llama-server can)
  setsid nohup bash -c "cd /tmp && for s in $shapes; do [ -f /tmp/ck-\$s.done ] || { \
      python3 -m quantserve.bench.make_checkpoint --shape \$s --out /tmp/ck-\$s --context 8192 && touch /tmp/ck-\$s.ready && \
      python3 -m quantserve convert /tmp/ck-\$s -f gguf-q8_0 -o /tmp/gguf-\$s -q && touch /tmp/ck-\$s.done; }; done" \
      > /tmp/checkpoints.log 2>&1 < /dev/null &
fi
if [ "$phase" = 1 ]; then
  # from /tmp: in the source tree `quantserve` would be the bare folder, not the installed package
  # the compiled blocks inside the CUDA graphs against eager first, then the attention kernel
  if [ "${GPU_TESTS:-0}" = 1 ]; then
    (cd /tmp && timeout 240 python3 -m pytest --import-mode=append -rA -q -p no:cacheprovider \
        "$repo/tests/serve/test_fastcore.py" "$repo/tests/serve/test_paged_attention.py" \
        "$repo/tests/serve/test_async_scheduling.py" \
        -k "compiled_cuda or compiled_triton or graphs_match or launched_ahead_give or close_to_fp32 or match_the_reference") \
        > "$out/gpu-tests.log" 2>&1 || log "gpu tests: rc=$?"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu-tests.log" >> "$out/bench.txt"
  fi
  checkpoint llama-3.2-1b
  rm -rf "$QUANTSERVE_HOME/compile"
  start_ours ours-1b-cold /tmp/ck-llama-3.2-1b "${ours[@]}" && { load ours-1b 8000 random; load ours-1b 8000 shared; stop; }
  # warm starts: decode steps one at a time (async scheduling's effect), and no prefix cache
  start_ours ours-1b-warm /tmp/ck-llama-3.2-1b "${ours[@]}" --no-async-scheduling && { load ours-1b-sync 8000 random; stop; }
  start_ours ours-1b-warm2 /tmp/ck-llama-3.2-1b "${ours[@]}" --no-prefix-cache && { load ours-1b-nocache 8000 shared; stop; }
  for i in $(seq 120); do [ -x /tmp/llama-cpp/bin/llama-server ] && break; sleep 2; done
  tail -n 3 /tmp/llama-build.out >> "$out/bench.txt"
  start_llama llama-1b /tmp/gguf-llama-3.2-1b/*.gguf && { load llama-1b 8001 random; load llama-1b 8001 shared; stop; }
elif [ ! -f /tmp/checkpoints.log ] && [ "$phase" != 2 ]; then
  # a fresh machine (the last one went back between calls): nothing of phase 2 is here, and
  # waiting for its checkpoint would spend the whole call
  log "phase $phase needs phase 2's files in /tmp: this machine is fresh, run phase 2 first"; exit 3
elif [ "$phase" = 2 ]; then
  checkpoint llama-3.1-8b ready
  rm -rf "$QUANTSERVE_HOME/compile"  # cold: nothing of the 1B shape's kernels either
  start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}" && { load ours-8b 8000 random; load ours-8b 8000 shared; stop; }
elif [ "$phase" = 3 ]; then
  checkpoint llama-3.1-8b
  for i in $(seq 150); do [ -x /tmp/llama-cpp/bin/llama-server ] && break; sleep 2; done
  start_llama llama-8b /tmp/gguf-llama-3.1-8b/*.gguf && { load llama-8b 8001 random; load llama-8b 8001 shared; stop; }
  start_ours ours-8b-warm /tmp/ck-llama-3.1-8b "${ours[@]}" --no-async-scheduling && { load ours-8b-sync 8000 random; stop; }
  start_ours ours-8b-warm2 /tmp/ck-llama-3.1-8b "${ours[@]}" --no-prefix-cache && { load ours-8b-nocache 8000 shared; stop; }
else
  capacity capacity-fp16-kv ${CAPACITY_FP16:-}
  capacity capacity-int8-kv --kv-cache-dtype int8 ${CAPACITY_INT8:-}
  (cd /tmp && timeout 120 python3 -m quantserve.bench.quality --shape 1b) > "$out/kv-quality-1b.txt" 2>&1 \
      || log "kv quality: rc=$?"
  tail -n 8 "$out/kv-quality-1b.txt" >> "$out/bench.txt"
fi
log "phase $phase done"
