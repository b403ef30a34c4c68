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
