#!/usr/bin/env bash
# The GPU checks that need no llama.cpp build, in two back-to-back calls on the lent GPU (a warm
# machine keeps /tmp between them).  Ray's wheels do not fit one call's 64 MiB carry with the
# checkout, so call 1 parks Ray's own wheel and call 2 brings the rest (bench/replicas_wheels.sh).
#   bench/gpu_checks.sh OUT 1   carry .rayw/ray and .rayw/pyd (pydantic: the engine's imports need
#                               it; nothing of the server runs in this call).  Ray's wheel parked in
#                               /tmp/qs-ray; the 1B and 8B checkpoints written, detached; the engine's
#                               GPU tests (the weight kernels, the paged attention kernel, the compiled
#                               blocks inside the CUDA graphs against eager); where a batch-1 decode
#                               step's time goes with ~700 tokens in the cache (1B int8:
#                               bench/step_profile.py); the 8B-class shapes of Qwen2.5-7B and
#                               Qwen3-8B against Llama-3.1-8B at batch 1, int8 (roofline %); the 8B
#                               step profile if time is left
#   bench/gpu_checks.sh OUT 2   carry .rayw/deps and .devwheels (without .devwheels/llama).  Ray
#                               installed; `--replicas 1` against a bare server
#                               (bench/replicas_overhead.sh, 1B int8, 3 rounds); then the 8B shape
#                               with its KV pool sized by itself: start-up and how many ~1,200-token
#                               requests run at once at --context 8192, fp16 and int8 KV
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site QUANTSERVE_HOME=/tmp/qs-home QUANTSERVE_TEST_CWD=/tmp PYTHONUNBUFFERED=1
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$out/bench.txt"; }
left() { echo $(( ${1:-585} - SECONDS )); }  # seconds left of the call's budget

if [ "$phase" = 1 ]; then
  mkdir -p /tmp/qs-ray && cp .rayw/ray/*.whl /tmp/qs-ray/
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .rayw/pyd/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" .
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) | tee "$out/bench.txt"
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" \
      | tee -a "$out/bench.txt"
  # checkpoints for call 2, detached (CPU and disk: they slow compiles here a little, not GPU timings)
  setsid nohup bash -c "cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape llama-3.2-1b --out /tmp/m1b \
      && python3 -m quantserve.bench.make_checkpoint --shape llama-3.1-8b --out /tmp/ck-llama-3.1-8b --context 8192 \
      && touch /tmp/checkpoints.done" > /tmp/checkpoints.log 2>&1 < /dev/null &
  # from /tmp: in the source tree `quantserve` would be the bare folder, not the installed package
  (cd /tmp && timeout 200 python3 -m pytest --import-mode=append -rA -q -p no:cacheprovider \
      "$repo/tests/serve/test_fastcore.py" "$repo/tests/serve/test_fastcore_startup.py" "$repo/tests/serve/test_paged_attention.py" "$repo/tests/serve/test_gpu_kernels.py" \
      -k "compiled_cuda or compiled_triton or paged or gpu or triton") > "$out/gpu-tests.log" 2>&1 || log "gpu tests: rc=$?"
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$out/gpu-tests.log" >> "$out/bench.txt"
  log "tests done"
  (cd /tmp && timeout 110 python3 -m quantserve.bench.step_profile --model 1b --quants int8 --context 700 \
      --prompt-len 0 --out "$out/step-1b-int8.json") > "$out/step-1b-int8.log" 2>&1 || log "step profile 1b: rc=$?"
  grep -vE "^\s*$" "$out/step-1b-int8.log" | tail -n 24 >> "$out/bench.txt"
  log "1b profile done"
  (cd /tmp && timeout "$(left 470)" python3 -m quantserve.bench.decode --models 8b,qwen2.5-7b,qwen3-8b --quants int8 \
      --batches 1 --generate-batches '' --new-tokens 128 --gpu-profile t4 --out "$out/families-int8.json") \
      > "$out/families-int8.log" 2>&1 || log "families decode: rc=$?"
  grep -E "tok/s|roofline|error|^\s*(8b|qwen)" "$out/families-int8.log" | tail -n 20 >> "$out/bench.txt"
  log "families done"
  if [ "$(left)" -gt 80 ]; then
    (cd /tmp && timeout "$(left)" python3 -m quantserve.bench.step_profile --model 8b --quants int8 --context 700 \
        --prompt-len 0 --out "$out/step-8b-int8.json") > "$out/step-8b-int8.log" 2>&1 || log "step profile 8b: rc=$?"
    grep -vE "^\s*$" "$out/step-8b-int8.log" | tail -n 24 >> "$out/bench.txt"
  fi
  tail -n 3 /tmp/checkpoints.log >> "$out/bench.txt"
  log "phase 1 done"
  exit 0
fi

if [ ! -d /tmp/qs-ray ]; then
  log "phase 2 needs phase 1's /tmp/qs-ray and checkpoints: this machine is fresh, run phase 1 first"; exit 3
fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" /tmp/qs-ray/*.whl \
    .rayw/deps/*.whl .devwheels/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" .
python3 -m pip install -q --no-index --no-deps --target /tmp/tools .devwheels/tools/*.whl 2>/dev/null || true
for i in $(seq 120); do [ -f /tmp/checkpoints.done ] && break; sleep 2; done
[ -f /tmp/checkpoints.done ] || { log "no checkpoints"; tail -n 5 /tmp/checkpoints.log | tee -a "$out/bench.txt"; exit 1; }
log "installed"
ROUNDS=3 timeout "$(left 400)" bash bench/replicas_overhead.sh "$site" "$out/replicas" > "$out/replicas.log" 2>&1 \
    || log "replicas overhead: rc=$?"
tail -n 14 "$out/replicas.log" >> "$out/bench.txt"
log "replicas done"
# the 8B shape, its pool sized by itself (no --kv-blocks): does it start, and how many run at once
capacity() {  # LABEL ARGS...: 64 concurrent ~1,200-token prompts at --context 8192
  local label=$1; shift
  local t0=$SECONDS
  (cd /tmp && exec python3 -m quantserve serve /tmp/ck-llama-3.1-8b --port 8000 --engine fast --weight-quant int8 \
      --gpu-profile t4 --max-batch 64 --context 8192 "$@") > "$out/$label.log" 2>&1 &
  local pid=$!
  until curl -sf -o /dev/null http://127.0.0.1:8000/health; do
    kill -0 $pid 2>/dev/null || { log "$label exited"; tail -n 20 "$out/$label.log" | tee -a "$out/bench.txt"; return 1; }
    [ "$(left)" -gt 20 ] || { log "$label: not ready in time"; kill $pid; return 1; }
    sleep 0.5
  done
  log "$label: ready after $(( SECONDS - t0 )) s"
  grep -E "KV|pool|blocks|ready|warm" "$out/$label.log" | tail -n 4 >> "$out/bench.txt"
  (cd /tmp && bash "$repo/bench/capacity_load.sh" "$out" "$label" "$(left)")
  kill -TERM $pid; wait $pid 2>/dev/null
}
[ "$(left)" -gt 200 ] && capacity capacity-fp16-kv
[ "$(left)" -gt 120 ] && capacity capacity-int8-kv --kv-cache-dtype int8
log "phase 2 done"
