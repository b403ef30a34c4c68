#!/usr/bin/env bash
# The paged engine on the lent GPU against llama.cpp's own llama-server, in back-to-back calls (the
# machine stays warm between them and keeps /tmp).  Random-weight Llama checkpoints of the 1B and
# 8B shapes with the default tokenizer; ours: --engine fast --weight-quant int8 --gpu-profile t4;
# theirs: llama-server on the Q8_0 GGUF of the same checkpoint, -np 32, flash attention.
#   bench/engine_v2.sh OUT 15  a fresh machine, 8B, one call: llama.cpp's build detached (carry .devllama too);
#                              ours cold (shared, random), warm --no-prefix-cache (shared), warm (shared); then
#                              llama-server on the Q8_0 GGUF (shared, random)
#   bench/engine_v2.sh OUT 16  phase 15's machine kept warm, 1B: llama-server (shared, random; httpx client), ours
#                              first start (shared, random), warm --no-prefix-cache (shared)
#   bench/engine_v2.sh OUT 17  a fresh machine, ours alone, 1B: the shared load on a first start
#   bench/engine_v2.sh OUT 18  a fresh machine, ours alone, 8B: cold start, random and shared loads; a warm start
#                              under py-spy from launch; then this tree against a base (.devwheels/base: the
#                              token buckets of powers of two only, no gc freeze), each warm: idle prompts and
#                              the shared load; 1B: the shared load on a first start, and on the base; every
#                              server with bench/gcwatch on its path (full collections into its log);
#                              FULL=0 leaves out the py-spy start and the 1B shape (~6 min)
#   bench/engine_v2.sh OUT 19  phase 18's machine kept warm after bench/fusion_gpu.sh (llama.cpp built, the 8B's
#                              Q8_0 GGUF): ours warm without and with the prefix cache, llama-server: idle, shared
#   bench/engine_v2.sh OUT 20  a fresh machine, ours alone, 1B (~2 min): the shared load with the prefix cache on a
#                              first start, then without it on a warm start
#   bench/engine_v2.sh OUT 21  a fresh machine, 8B (~4 min; carry .devllama too): llama.cpp's build detached; where a
#                              start's time goes, a cold start and a warm one under py-spy from launch (every thread,
#                              raw stacks: bench/startup_profile.py sums them by part), a warm start without it; then
#                              the Q8_0 GGUF for phase 22
#   bench/engine_v2.sh OUT 22  phase 21's machine kept warm: the random loads (1, 8, 32; each level its own prompts)
#                              and idle prompts, ours warm then llama-server on the Q8_0 GGUF
#   bench/engine_v2.sh OUT 23  a fresh machine (~8 min; carry .devllama too): how the image keeps bytecode; the 8B's
#                              start with nothing cached, a warm start without the bytecode cache
#                              (QUANTSERVE_BYTECODE_CACHE=0) and two with it; then the 1B: its first start, the random
#                              loads and idle prompts, ours then llama-server on its Q8_0 GGUF
#   bench/engine_v2.sh OUT 24  a fresh machine, 8B, the whole table in one call (carry .devllama too): llama.cpp's
#                              build detached; ours cold (nothing cached: random loads, idle prompts, shared load),
#                              a warm start with --no-prefix-cache (shared load); the Q8_0 GGUF; llama-server on
#                              the same three loads if its build is ready in time (else phase 25 runs them)
#   bench/engine_v2.sh OUT 25  phase 24's machine kept warm: llama-server on the 8B if phase 24 left it out; the 1B:
#                              ours on a first start (random, idle, shared), warm with --no-prefix-cache (shared),
#                              llama-server (random, idle, shared; httpx client); the GPU tests of the engine and
#                              its kernels in what time is left
# The phases that earlier sections of bench/RESULTS.md ran (1-14) are in git history at the commit
# each section names; the capacity runs at --context 8192 are bench/gpu_checks.sh's call 2.
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
    idle) args=(--concurrency 1 --num-prompts 24 --input-len 225 --seed 7) ;;  # not the random load's prompts
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

install() {
  [ -d "$site/fastapi" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      .devwheels/*.whl .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
  # this tree's quantserve every time: a warm machine keeps the last call's
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" .
}

build_llama_cpp() {  # llama.cpp's llama-server from the vendored source into /tmp/llama-cpp, detached on cores 8-15
                    # (~6 min; carry .devllama)
  setsid nohup nice -n 19 taskset -c 8-15 bash .devwheels/device-llama-cpp.sh .devllama/llama_cpp_python-0.3.36.tar.gz \
      /tmp/llama-cpp 90 > /tmp/llama-build.out 2>&1 < /dev/null &
}
checkpoint() {  # SHAPE: the random-weight checkpoint /tmp/ck-SHAPE (bench.make_checkpoint)
  (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape "$1" --out "/tmp/ck-$1" --context 8192) \
      >> "/tmp/checkpoints-$1.log" 2>&1
}
gguf() {  # SHAPE: its Q8_0 GGUF in /tmp/gguf-SHAPE
  (cd /tmp && python3 -m quantserve convert "/tmp/ck-$1" -f gguf-q8_0 -o "/tmp/gguf-$1" -q) >> "/tmp/checkpoints-$1.log" 2>&1
}

if [ "$phase" = 15 ]; then
  install
  machine
  build_llama_cpp
  checkpoint llama-3.1-8b || { log "no checkpoint"; exit 1; }
  rm -rf "$QUANTSERVE_HOME/compile"
  start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}" && { shared_split ours-8b; load ours-8b 8000 random; stop; }
  start_ours ours-8b-nocache /tmp/ck-llama-3.1-8b "${ours[@]}" --no-prefix-cache && { shared_split ours-8b-nocache; stop; }
  gguf llama-3.1-8b || log "no GGUF"
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
  checkpoint llama-3.2-1b && gguf llama-3.2-1b || { log "no checkpoint"; exit 1; }
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
  checkpoint llama-3.2-1b || { log "no checkpoint"; exit 1; }
  start_ours ours-1b-cold /tmp/ck-llama-3.2-1b "${ours[@]}" && { shared_split ours-1b; stop; }
  finish
fi

if [ "$phase" = 18 ]; then
  install
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools .devwheels/tools/*.whl
  rm -rf /tmp/site-base && cp -r "$site" /tmp/site-base && cp -r .devwheels/base/. /tmp/site-base/
  machine
  export PYTHONPATH=$repo/bench/gcwatch:$site
  checkpoint llama-3.1-8b || { log "no checkpoint"; exit 1; }
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
    checkpoint llama-3.2-1b || { log "no checkpoint"; exit 1; }
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

if [ "$phase" = 20 ]; then  # a fresh machine, ours alone, 1B (~2 min): the shared load with the prefix cache (a first
                            # start), then without it (a warm start): the cached share of the uncached time
  install
  machine
  checkpoint llama-3.2-1b || { log "no checkpoint"; exit 1; }
  start_ours ours-1b-first /tmp/ck-llama-3.2-1b "${ours[@]}" && { shared_split ours-1b-first; stop; }
  start_ours ours-1b-nocache /tmp/ck-llama-3.2-1b "${ours[@]}" --no-prefix-cache && { shared_split ours-1b-nocache; stop; }
  finish
fi

if [ "$phase" = 21 ]; then
  install
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools .devwheels/tools/*.whl
  machine
  build_llama_cpp
  checkpoint llama-3.1-8b || { log "no checkpoint"; exit 1; }
  rm -rf "$QUANTSERVE_HOME/compile"
  for label in ours-8b-cold-pyspy ours-8b-warm-pyspy; do
    (cd /tmp && exec /tmp/tools/bin/py-spy record -r 100 --idle --threads -f raw -o "$out/$label.txt" -- \
        python3 -m quantserve serve /tmp/ck-llama-3.1-8b --port 8000 "${ours[@]}") > "$out/$label.log" 2>&1 &
    PID=$!
    wait_ready 8000 $PID $label; kill -TERM $(pgrep -P $PID) 2>/dev/null; wait $PID 2>/dev/null
  done
  start_ours ours-8b-warm /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  gguf llama-3.1-8b || log "no GGUF"
  finish
fi

if [ "$phase" = 22 ]; then  # phase 21's machine kept warm (the 8B checkpoint, its Q8_0 GGUF, llama.cpp's build)
  install; machine
  for i in $(seq 300); do [ -x /tmp/llama-cpp/bin/llama-server ] && break; sleep 1; done
  start_ours ours-8b-warm /tmp/ck-llama-3.1-8b "${ours[@]}" && { load ours-8b 8000 random; load ours-8b 8000 idle; stop; }
  start_llama llama-8b /tmp/gguf-llama-3.1-8b/*.gguf && { load llama-8b 8001 random; load llama-8b 8001 idle; stop; }
  finish
fi

if [ "$phase" = 23 ]; then
  install
  machine
  build_llama_cpp
  python3 - <<'EOF' | tee -a "$out/bench.txt"  # does the image give Python its libraries' bytecode, or let it write it?
import importlib.util, os, sys
from pathlib import Path
spec = importlib.util.find_spec("torch")
print("PYTHONDONTWRITEBYTECODE:", os.environ.get("PYTHONDONTWRITEBYTECODE"), "| sys.flags.dont_write_bytecode:",
      sys.flags.dont_write_bytecode, "| torch's bytecode:", Path(importlib.util.cache_from_source(spec.origin)).is_file(),
      "| torch's folder writable:", os.access(Path(spec.origin).parent, os.W_OK), "|", Path(spec.origin).parent)
EOF
  checkpoint llama-3.1-8b || { log "no checkpoint"; exit 1; }
  rm -rf "$QUANTSERVE_HOME/compile" "$QUANTSERVE_HOME/bytecode"
  start_ours ours-8b-first /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  QUANTSERVE_BYTECODE_CACHE=0 start_ours ours-8b-warm-nobytecode /tmp/ck-llama-3.1-8b "${ours[@]}" && stop
  for n in 1 2; do start_ours ours-8b-warm-$n /tmp/ck-llama-3.1-8b "${ours[@]}" && stop; done
  du -sh "$QUANTSERVE_HOME/bytecode" | tee -a "$out/bench.txt"
  checkpoint llama-3.2-1b && gguf llama-3.2-1b || { log "no 1B checkpoint"; finish; }
  start_ours ours-1b-first /tmp/ck-llama-3.2-1b "${ours[@]}" && { load ours-1b 8000 random; load ours-1b 8000 idle; stop; }
  while [ ! -x /tmp/llama-cpp/bin/llama-server ] && [ $SECONDS -lt 470 ]; do sleep 1; done
  log "llama.cpp's build: $([ -x /tmp/llama-cpp/bin/llama-server ] && echo ready || echo 'not ready')"
  # httpx for llama-server: under aiohttp it dropped a few kept-alive connections (phase 15)
  start_llama llama-1b /tmp/gguf-llama-3.2-1b/*.gguf && {
    SERVE_EXTRA="--client httpx" load llama-1b 8001 random; SERVE_EXTRA="--client httpx" load llama-1b 8001 idle; stop; }
  finish
fi

llama_loads() {  # SHAPE: llama-server on the shape's Q8_0 GGUF, the random loads, idle prompts, the shared load
  local client=(); [ "$1" = llama-3.2-1b ] && client=(--client httpx)  # aiohttp dropped kept-alive connections there (phase 15)
  local label=llama-${1##*-}
  start_llama "$label" /tmp/gguf-$1/*.gguf && {
    for kind in random idle shared; do SERVE_EXTRA="${client[*]}" load "$label" 8001 $kind; done; stop; }
}

if [ "$phase" = 24 ]; then
  install
  machine
  build_llama_cpp
  checkpoint llama-3.1-8b || { log "no checkpoint"; exit 1; }
  rm -rf "$QUANTSERVE_HOME"  # cold: no compile cache, no bytecode cache, no kernel choices
  start_ours ours-8b-cold /tmp/ck-llama-3.1-8b "${ours[@]}" \
      && { load ours-8b 8000 random; load ours-8b 8000 idle; shared_split ours-8b; stop; }
  start_ours ours-8b-nocache /tmp/ck-llama-3.1-8b "${ours[@]}" --no-prefix-cache && { shared_split ours-8b-nocache; stop; }
  gguf llama-3.1-8b || log "no GGUF"
  while [ ! -x /tmp/llama-cpp/bin/llama-server ] && [ $SECONDS -lt 440 ]; do sleep 1; done
  log "llama.cpp's build: $([ -x /tmp/llama-cpp/bin/llama-server ] && echo ready || echo 'not ready: phase 25 runs it')"
  [ -x /tmp/llama-cpp/bin/llama-server ] && { llama_loads llama-3.1-8b; touch /tmp/llama-8b.done; }
  finish
fi

if [ "$phase" = 25 ]; then  # phase 24's machine kept warm
  install; machine
  if [ ! -f /tmp/llama-8b.done ]; then
    for i in $(seq 240); do [ -x /tmp/llama-cpp/bin/llama-server ] && break; sleep 1; done
    llama_loads llama-3.1-8b
  fi
  checkpoint llama-3.2-1b && gguf llama-3.2-1b || { log "no 1B checkpoint"; finish; }
  start_ours ours-1b-first /tmp/ck-llama-3.2-1b "${ours[@]}" \
      && { load ours-1b 8000 random; load ours-1b 8000 idle; shared_split ours-1b; stop; }
  start_ours ours-1b-nocache /tmp/ck-llama-3.2-1b "${ours[@]}" --no-prefix-cache && { shared_split ours-1b-nocache; stop; }
  llama_loads llama-3.2-1b
  rest=$(( 560 - SECONDS ))
  if [ $rest -gt 90 ]; then  # the engine's and kernels' GPU tests at this commit, in what time is left
    (cd /tmp && QUANTSERVE_HOME=/tmp/qs-tests timeout $rest python3 -m pytest --import-mode=append -q -p no:cacheprovider -rfs \
        "$repo/tests/serve/test_gpu_kernels.py" "$repo/tests/serve/test_paged_attention.py") > "$out/tests.log" 2>&1 \
        || log "tests: rc=$?"
    grep -E "^FAILED|passed|failed|rror" "$out/tests.log" | tail -n 12 >> "$out/bench.txt"
  fi
  finish
fi

echo "engine_v2.sh: unknown phase '$phase' (this file has 15-25)" >&2; exit 2
