# Shell steps the GPU bench scripts share.  Source it after setting $out (the call's work folder)
# and, where the packages are installed apart, $site (their PYTHONPATH).
install_site() {  # [WHEEL...]: .devwheels (and WHEELs) into $site once a machine, then this tree's package
  [ -d "$site/fastapi" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .devwheels/*.whl "$@"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" . 2>&1 | grep -v WARNING
}
log() { echo "[$SECONDS s] $*" | tee -a "$out/bench.txt"; }
left() { local v=$(( $1 - SECONDS )); [ "$v" -ge 5 ] || v=5; echo "$v"; }  # seconds until mark $1
decode() {  # LIMIT_S NAME ARGS...: one bench decode run (T4 profile, 128 new tokens), its rows into bench.txt
  local limit=$1 name=$2; shift 2
  [ "$limit" -gt 30 ] || { log "decode $name: skipped (no time left)"; return; }
  (cd /tmp && PYTHONPATH=${site:-${PYTHONPATH:-}} timeout "$limit" python3 -m quantserve.bench.decode \
      --generate-batches '' --new-tokens 128 --gpu-profile t4 --no-fit-check "$@" --out "$out/decode-$name.json") \
      > "$out/decode-$name.log" 2>&1 || log "decode $name: rc=$?"
  grep -E "tok/s|error|Error|batch [0-9]+:|kernels kept" "$out/decode-$name.log" | tail -n 20 >> "$out/bench.txt"
}
llama_bench() {  # LIMIT_S GGUF...: llama-bench at batch 1 (128 tokens, flash attention) on each GGUF there is, into bench.txt
  local limit=$1 m; shift
  for m in "$@"; do
    [ -f "$m" ] && timeout "$limit" /tmp/llama-cpp/bin/llama-bench -m "$m" -p 0 -n 128 -fa 1 -ngl 99 -r 3 -o md \
        2>/dev/null | grep -E "^\|" >> "$out/bench.txt"
  done
}
start_with_llama() {  # a fresh machine: .devwheels (with the GGUF writer) and the package installed, the GPU
  # named in bench.txt, llama.cpp's build and the 8B GGUFs started detached (bench/dp4a_gpu.sh "llama")
  install_site .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  log "installed"
  bash bench/dp4a_gpu.sh /tmp/llama-start llama > /dev/null
}
gpu_tests() {  # LIMIT_S K_EXPR FILE...: pytest from /tmp (the installed package, not the source tree's folder)
  local limit=$1 expr=$2; shift 2
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-tests timeout "$limit" python3 -m pytest --import-mode=append -q \
      -p no:cacheprovider -rfs "$@" -k "$expr") > "$out/tests.log" 2>&1 || log "tests: rc=$?"
  grep -E "^FAILED|^SKIPPED|passed|failed|Error" "$out/tests.log" | tail -n 12 >> "$out/bench.txt"; log "tests done"
}
step_profile() {  # LIMIT_S NAME ARGS...: bench.step_profile on the 8B, its summary into bench.txt
  local limit=$1 name=$2; shift 2
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-prof timeout "$limit" python3 -m quantserve.bench.step_profile --model 8b \
      "$@" --out "$out/profile-$name.json") > "$out/profile-$name.log" 2>&1 || log "profile $name: rc=$?"
  grep -vE "UserWarning|_warn_once" "$out/profile-$name.log" | grep -E "^8b|^    |prompt of|rror" >> "$out/bench.txt"
}
llama_bench_8b_then_cold() {  # WAIT_UNTIL_S: llama-bench on the 8B's Q8_0 / Q4_K_M once the GGUFs exist (or by
  # WAIT_UNTIL_S), then bench/cold_start.sh's "shipped" phase until 585 s; both into bench.txt
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt "$1" ]; do sleep 2; done
  tail -n 4 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  timeout $(left 585) bash bench/cold_start.sh "$out/cold" shipped > /dev/null 2>&1 || log "cold start: rc=$?"
  cat "$out/cold/bench.txt" >> "$out/bench.txt"; rm -f "$out/cold/"*.log "$out/cold/results.tgz"
}
