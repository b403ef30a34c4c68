#!/usr/bin/env bash
# How many long requests a server on :8000 runs at once: 64 concurrent ~1,200-token prompts
# (bench.serve --input-len 390 words), 128 tokens out each; /metrics sampled every 0.2 s for the
# running count.  Writes OUT/LABEL.json, OUT/LABEL-load.log, OUT/LABEL-running.txt and appends the
# figures to OUT/bench.txt.  Run from /tmp on the GPU machine (the installed package, not the tree).
#   usage: bench/capacity_load.sh OUT LABEL [TIMEOUT_S (200)]
set -uo pipefail
out=$1; label=$2; limit=${3:-200}
(while sleep 0.2; do curl -s http://127.0.0.1:8000/metrics | grep -E "^quantserve:num_requests_running "; done) \
    > "$out/$label-running.txt" 2>/dev/null &
sampler=$!
timeout "$limit" python3 -m quantserve.bench.serve --base-url http://127.0.0.1:8000/v1 --concurrency 64 \
    --num-prompts 64 --input-len 390 --output-len 128 --ignore-eos --no-warmup --label "$label" \
    --out "$out/$label.json" > "$out/$label-load.log" 2>&1 || echo "$label load: rc=$?" >> "$out/bench.txt"
kill $sampler
echo "$label: most running at once $(sort -k2 -n "$out/$label-running.txt" | tail -n 1)" | tee -a "$out/bench.txt"
curl -s http://127.0.0.1:8000/metrics | grep -E "^quantserve:(num_preemptions|kv_cache_blocks_total)" | tee -a "$out/bench.txt"
tail -n 4 "$out/$label-load.log" >> "$out/bench.txt"
