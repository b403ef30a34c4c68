#!/usr/bin/env bash
# The least device time for the prompt tiles' grid order (triton_mm.tiled_grid): install, then the
# per-layer race of the 8B's 512-row matmuls alone (fp16, dequantize-then-cuBLAS, the 128-row tiles
# with row tiles first and with output tiles first; each row's error against the fp32 product),
# by END_S (default 170).  bench/rows_first_gpu.sh is the full measurement.
#   bench/rows_first_race.sh OUT [END_S]      (.devwheels carried)
set -uo pipefail
out=$(realpath -m "$1"); end=${2:-170}; mkdir -p "$out"; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source bench/gpu_lib.sh  # install_site, log, left
install_site
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) >> "$out/bench.txt"
log "installed"
(cd /tmp && QUANTSERVE_HOME=/tmp/qs-race timeout $(left "$end") python3 -m quantserve.bench.kernel_race --shapes 8b \
    --layers qkv,o,gate_up,down --batches 512 \
    --kinds fp16,int8-dense,int8-tiles,int8-coltiles,int4-dense,int4-tiles,int4-coltiles --out "$out/race-512.json") \
    > "$out/race-512.log" 2>&1 || log "race: rc=$?"
grep -E "M=|copy bandwidth" "$out/race-512.log" >> "$out/bench.txt"; log "race done"
cat "$out/bench.txt"
