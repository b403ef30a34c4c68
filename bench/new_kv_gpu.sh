#!/usr/bin/env bash
# A decode step's rotary embedding and cache write inside the paged attention kernel
# (fastcore/attention.py, QUANTSERVE_ATTENTION_NEW_KV) on the lent GPU, in two back-to-back calls on
# one machine (it keeps /tmp and the detached llama.cpp build); .devwheels and .devllama carried:
#   bench/new_kv_gpu.sh OUT 1  install; llama.cpp's build and the 8B GGUFs started detached (bench/dp4a_gpu.sh
#                              "llama"); GPU tests: the attention kernels against the reference (fp16 too),
#                              the compiled, CUDA-graphed decode against eager (fp32; int8 through our
#                              kernels); the 8B decode step kernel by kernel, int8 and int4, and int8 with
#                              QUANTSERVE_ATTENTION_NEW_KV=0 (same call); bench decode at batch 8 and 32
#                              (fp16, int8, int4)
#   bench/new_kv_gpu.sh OUT 2  bench decode 8B at batch 1 (fp16, int8, int4; int8 with NEW_KV=0), then
#                              llama-bench on Q8_0 / Q4_K_M in the same call; bench/cold_start.sh "shipped"
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, log, left, decode, llama_bench
if [ "$phase" = 1 ]; then
  install_site .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  log "installed"
  bash bench/dp4a_gpu.sh /tmp/llama-start llama > /dev/null
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-tests timeout 200 python3 -m pytest --import-mode=append -q -p no:cacheprovider \
      -rfs "$repo/tests/serve/test_paged_attention.py" "$repo/tests/serve/test_fastcore.py" \
      -k "not test_fastcore or compiled_cuda_decode_matches_eager or (compiled_triton_decode and int8 and not gemlite)") \
      > "$out/tests.log" 2>&1 || log "tests: rc=$?"
  grep -E "^FAILED|^SKIPPED|passed|failed|Error" "$out/tests.log" | tail -n 12 >> "$out/bench.txt"; log "tests done"
  profile() {  # LIMIT_S NAME ARGS...
    local limit=$1 name=$2; shift 2
    (cd /tmp && QUANTSERVE_HOME=/tmp/qs-prof timeout "$limit" python3 -m quantserve.bench.step_profile --model 8b \
        --prompt-len 0 "$@" --out "$out/profile-$name.json") > "$out/profile-$name.log" 2>&1 || log "profile $name: rc=$?"
    grep -vE "UserWarning|_warn_once" "$out/profile-$name.log" | grep -E "^8b|^    |rror" >> "$out/bench.txt"
  }
  profile $(left 400) default --quants int8,int4
  QUANTSERVE_ATTENTION_NEW_KV=0 profile $(left 470) separate-kv --quants int8
  log "profiles done"
  QUANTSERVE_HOME=/tmp/qs-b832 decode $(left 585) 8b-b8-b32 --models 8b --quants none,int8,int4 --kernels triton \
      --batches 8,32
elif [ "$phase" = 2 ]; then
  QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 150) 8b-b1 --models 8b --quants none,int8,int4 --kernels triton --batches 1
  QUANTSERVE_ATTENTION_NEW_KV=0 QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 200) 8b-b1-separate-kv --models 8b \
      --quants int8 --kernels triton --batches 1
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt 300 ]; do sleep 2; done
  tail -n 4 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  timeout $(left 585) bash bench/cold_start.sh "$out/cold" shipped > /dev/null 2>&1 || log "cold start: rc=$?"
  cat "$out/cold/bench.txt" >> "$out/bench.txt"; rm -f "$out/cold/"*.log "$out/cold/results.tgz"
else
  echo "new_kv_gpu.sh: unknown phase '$phase' (1 or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
