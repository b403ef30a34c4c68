#!/usr/bin/env bash
# The int4 kernel for 2-16 rows (server/fastcore/triton_rows.py) on the lent GPU, one call (~8 min;
# .devwheels carried; a machine bench/cold_start.sh left warm saves the install):
#   the GPU tests of the weight kernels (every few-rows config against the dequantized matmul, the
#   launcher at 1-512 rows, the shipped kernel table where there is one for this GPU);
#   the per-layer race on the 8B shape at 4, 8 and 16 rows ($RACE_BATCHES): fp16 (cuBLAS), int4 as the launcher
#   chooses, the tiled `tl.dot` kernel alone and the few-rows kernel alone;
#   bench decode of the 8B shape at batch 8 and 32 under the T4 profile, int4 then fp16 (the baseline,
#   same call): the "no quantized path slower per step than fp16".
#   bench/rows_gpu.sh OUT    (DECODE=0: tests and race only, the race ending by $RACE_END s, default 380)
set -uo pipefail
dest=$(realpath -m "$1"); out=/tmp/rows-gpu; rm -rf "$out"; mkdir -p "$out" "$dest"; repo=$PWD; site=/tmp/site
export QUANTSERVE_HOME=/tmp/qs-rows PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # log, left, decode
install_site
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
log "installed"
# the tests this kernel, the batch-1 loads ahead and the launcher's timing touch (the whole file takes over 5 min on an H200)
(cd /tmp && PYTHONPATH=$site timeout 200 python3 -m pytest --import-mode=append -q -p no:cacheprovider -rfs \
    "$repo/tests/serve/test_gpu_kernels.py" "$repo/tests/serve/test_gemv_forms.py" \
    -k "few_rows or launcher or graph_replays or split_k or shipped_table or loaded_ahead") > "$out/gpu-tests.log" 2>&1 \
    || log "gpu tests: rc=$?"
grep -E "^FAILED|^SKIPPED|passed|failed" "$out/gpu-tests.log" >> "$out/bench.txt"; log "tests done"
(cd /tmp && PYTHONPATH=$site timeout $(left ${RACE_END:-380}) python3 -m quantserve.bench.kernel_race --shapes 8b --batches ${RACE_BATCHES:-4,8,16} \
    --kinds fp16,int4,int4-tiled,int4-rows --out "$out/race-8b.json") > "$out/race-8b.log" 2>&1 || log "race: rc=$?"
sed -n '/^| layer/,$p' "$out/race-8b.log" >> "$out/bench.txt"; log "race done"
if [ "${DECODE:-1}" = 1 ]; then
  decode $(left 500) 8b-int4 --models 8b --quants int4 --kernels triton --batches 8,32
  decode $(left 580) 8b-fp16 --models 8b --quants none --batches 8,32
fi
tar czf "$dest/results.tgz" -C "$out" . && cp "$out/bench.txt" "$dest/"; cat "$out/bench.txt"
