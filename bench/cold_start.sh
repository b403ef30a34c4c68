#!/usr/bin/env bash
# Cold starts on the lent GPU with and without the weight-kernel table shipped for it
# (server/fastcore/kernel_tables.py), in back-to-back calls on one machine (it keeps /tmp).
#   bench/cold_start.sh OUT 1  a fresh machine: random-weight checkpoints of the 8B and 1B shapes
#                              (the public models' vocabularies); each started with nothing cached and
#                              the tables off (what every first start did before); the table written
#                              from those two starts' choices (bench/kernel_table.py) into the
#                              installed package and OUT; the 8B started cold with it, then warm,
#                              a greedy reply from each 8B server; the 1B cold with it
#   bench/cold_start.sh OUT 2  the same machine (bench/rows_gpu.sh runs the kernels' GPU tests with the table
#                              between the two, ~5 min): the 8B cold without the table, then with it (second
#                              samples); the 8B in int4 cold without a table, its choices merged into the
#                              table, then cold with it
#   bench/cold_start.sh OUT shipped  the 8B int8 cold with the table the package ships for this GPU, then
#                              warm (same home: a greedy reply from each, compared), the 8B int4 cold with it
# "Cold": a QUANTSERVE_HOME of its own (no compile cache, no bytecode cache, no kernel choices).
# Ours: --engine fast --weight-quant int8 (WQ) --gpu-profile t4 --max-batch 64 --context 2048 (64: the
# decode batches' largest tile bucket, so the table covers it).  Run from the repo root with
# .devwheels carried.
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site QUANTSERVE_TEST_CWD=/tmp
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$out/bench.txt"; }
ours=(--engine fast --gpu-profile t4 --max-batch 64 --context 2048)
tables=$site/quantserve/server/fastcore/kernel_tables

install() {
  [ -d "$site/fastapi" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .devwheels/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" .
  mkdir -p "$tables" && cp /tmp/kernel-tables/*.json "$tables/" 2>/dev/null  # phase 1's table, on a later call
  true
}
machine() {
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) | tee -a "$out/bench.txt"
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" \
      | tee -a "$out/bench.txt"
}
checkpoint() {  # SHAPE -> /tmp/ck-SHAPE (the public model's vocabulary)
  [ -f "/tmp/ck-$1/config.json" ] || (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape "$1" --shape-vocab \
      --out "/tmp/ck-$1" --context 8192) >> "$out/checkpoints.log" 2>&1
}
start() {  # LABEL HOME CHECKPOINT [env...]: our server on :8000 (weights $WQ, default int8) with its own
           # QUANTSERVE_HOME; seconds to a 200 on /health
  local label=$1 home=$2 ck=$3 t0=$SECONDS; shift 3
  (cd /tmp && exec env QUANTSERVE_HOME="$home" "$@" python3 -m quantserve serve "$ck" --port 8000 "${ours[@]}" \
      --weight-quant "${WQ:-int8}") \
      > "$out/$label.log" 2>&1 &
  PID=$!
  until curl -sf -o /dev/null http://127.0.0.1:8000/health; do
    kill -0 $PID 2>/dev/null || { log "$label exited"; tail -n 30 "$out/$label.log" | tee -a "$out/bench.txt"; return 1; }
    sleep 0.25
  done
  log "$label: ready after $(( SECONDS - t0 )) s"
  curl -s http://127.0.0.1:8000/health | python3 -c "import json, sys; x = json.load(sys.stdin); print('  ready_s', \
x.get('ready_s'), '| kernel_table', x.get('kernel_table'), '| choices loaded', x.get('kernel_choices_loaded'), \
'| start_up_s', x.get('start_up_s'))" 2>&1 | tee -a "$out/bench.txt"
}
probe() {  # LABEL: a greedy reply of 32 tokens, its text into OUT/LABEL-greedy.txt
  python3 - "$out/$1-greedy.txt" <<'EOF' 2>&1 | tee -a "$out/bench.txt"
import json, sys, urllib.request
model = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v1/models"))["data"][0]["id"]
body = json.dumps({"model": model, "prompt": "The history of the river begins", "max_tokens": 32, "temperature": 0}).encode()
req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", body, {"Content-Type": "application/json"})
text = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"]
open(sys.argv[1], "w").write(text)
print("  greedy:", repr(text[:80]))
EOF
}
stop() { kill -TERM "$PID" 2>/dev/null; wait "$PID" 2>/dev/null || true; }
finish() { (cd "$out" && tar czf results.tgz *.log *.txt *.json 2>/dev/null); log "phase $phase done"; exit 0; }

if [ "$phase" = 1 ]; then
  install; machine
  rm -f "$tables"/*.json /tmp/kernel-tables/*.json  # the shipped tables set aside: this call writes the table anew
  checkpoint llama-3.1-8b && checkpoint llama-3.2-1b || { log "no checkpoint"; tail "$out/checkpoints.log"; exit 1; }
  log "checkpoints written"
  start ours-8b-cold-notable /tmp/qs-8b-a /tmp/ck-llama-3.1-8b QUANTSERVE_KERNEL_TABLES=0 && { probe ours-8b-cold-notable; stop; }
  start ours-1b-cold-notable /tmp/qs-1b-a /tmp/ck-llama-3.2-1b QUANTSERVE_KERNEL_TABLES=0 && stop
  gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())")
  mkdir -p /tmp/kernel-tables
  (cd /tmp && python3 -m quantserve.bench.kernel_table --gpu "$gpu" --out /tmp/kernel-tables \
      /tmp/qs-8b-a/compile/*/weight-kernels.json /tmp/qs-1b-a/compile/*/weight-kernels.json) | tee -a "$out/bench.txt"
  cp /tmp/kernel-tables/*.json "$tables/" && cp /tmp/kernel-tables/*.json "$out/"
  start ours-8b-cold-table /tmp/qs-8b-b /tmp/ck-llama-3.1-8b && { probe ours-8b-cold-table; stop; }
  start ours-8b-warm /tmp/qs-8b-b /tmp/ck-llama-3.1-8b && { probe ours-8b-warm; stop; }
  start ours-1b-cold-table /tmp/qs-1b-b /tmp/ck-llama-3.2-1b && stop
  # the same kernel choices (the table, then the warm start's kept ones): the same reply is expected;
  # the untuned start may choose other kernels, whose rounding differs
  cmp -s "$out/ours-8b-cold-table-greedy.txt" "$out/ours-8b-warm-greedy.txt" \
      && log "greedy replies, cold with the table and warm: the same" || log "greedy replies, cold with the table and warm: they differ"
  cmp -s "$out/ours-8b-cold-notable-greedy.txt" "$out/ours-8b-cold-table-greedy.txt" \
      && log "greedy replies, untuned and with the table: the same" || log "greedy replies, untuned and with the table: they differ"
  finish
fi

if [ "$phase" = 2 ]; then
  [ -f /tmp/kernel-tables/*.json ] || { log "phase 2 needs phase 1's table in /tmp/kernel-tables"; exit 3; }
  install; machine
  # bench/llama_ggufs.sh removes the 8B checkpoint once its GGUF is written (the disk is 64 GB)
  checkpoint llama-3.1-8b || { log "no checkpoint"; tail "$out/checkpoints.log"; exit 1; }
  start ours-8b-cold-notable-2 /tmp/qs-8b-c /tmp/ck-llama-3.1-8b QUANTSERVE_KERNEL_TABLES=0 && stop
  start ours-8b-cold-table-2 /tmp/qs-8b-d /tmp/ck-llama-3.1-8b && stop
  # int4: its choices added to the table, then a cold start with it
  WQ=int4 start ours-8b-int4-cold-notable /tmp/qs-8b-int4-a /tmp/ck-llama-3.1-8b QUANTSERVE_KERNEL_TABLES=0 && stop
  (cd /tmp && python3 -m quantserve.bench.kernel_table --gpu "$(python3 -c "import torch; print(torch.cuda.get_device_name())")" \
      --out /tmp/kernel-tables /tmp/qs-8b-int4-a/compile/*/weight-kernels.json) | tee -a "$out/bench.txt"
  cp /tmp/kernel-tables/*.json "$tables/" && cp /tmp/kernel-tables/*.json "$out/"
  WQ=int4 start ours-8b-int4-cold-table /tmp/qs-8b-int4-b /tmp/ck-llama-3.1-8b && stop
  finish
fi

if [ "$phase" = shipped ]; then  # what a user gets: the table as the package ships it, no table written here
  rm -f /tmp/kernel-tables/*.json  # a table an earlier call of this machine wrote is not the shipped one
  install; machine
  checkpoint llama-3.1-8b || { log "no checkpoint"; tail "$out/checkpoints.log"; exit 1; }
  start ours-8b-cold-shipped /tmp/qs-8b-s1 /tmp/ck-llama-3.1-8b && { probe ours-8b-cold-shipped; stop; }
  start ours-8b-warm-shipped /tmp/qs-8b-s1 /tmp/ck-llama-3.1-8b && { probe ours-8b-warm-shipped; stop; }
  cmp -s "$out/ours-8b-cold-shipped-greedy.txt" "$out/ours-8b-warm-shipped-greedy.txt" \
      && log "greedy replies of the two starts: the same" || log "greedy replies of the two starts: they differ"
  WQ=int4 start ours-8b-int4-cold-shipped /tmp/qs-8b-int4-s1 /tmp/ck-llama-3.1-8b && stop
  finish
fi

echo "cold_start.sh: unknown phase '$phase' (1, 2 or shipped)" >&2; exit 2
