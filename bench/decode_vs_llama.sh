#!/usr/bin/env bash
# Second call on the lent GPU, right after bench/kernels_gpu.sh on the same machine: batch-1 and
# batched decode of our fast engine (T4 profile) in fp16, int8 and int4, each quantized format on
# the library that won bench kernels' step total at batch 1, then llama.cpp's own llama-bench on the
# F16 / Q8_0 / Q4_K_M GGUFs of the same shapes, one after the other on the same GPU.
#   usage: bench/decode_vs_llama.sh OUT_DIR
set -uo pipefail
out=$(realpath -m "$1"); mkdir -p "$out"
export PYTHONPATH=/tmp/site QUANTSERVE_HOME=/tmp/qs-home
cd /tmp
pick() {  # FORMAT SHAPE: triton or gemlite, the lower batch-1 step weight time in /tmp/kernels.json
  python3 - "$1" "$2" <<'PY'
import json, sys
fmt, shape = sys.argv[1:]
try:
    step = json.load(open("/tmp/kernels.json"))["summary"][f"{shape} M=1"]["step_weight_ms"]
    mine = {k.split("-")[1]: v for k, v in step.items() if k.startswith(fmt + "-") and k.split("-")[1] in ("triton", "gemlite")}
    print(min(mine, key=mine.get))
except Exception:
    print("triton")
PY
}
k8=$(pick int8 8b); k4=$(pick int4 8b); k1=$(pick int8 1b)
echo "kernels: 8B int8 $k8, 8B int4 $k4, 1B int8 $k1" | tee "$out/bench.txt"
common=(--batches 1,8,32 --generate-batches '' --new-tokens 128 --gpu-profile t4)
timeout 140 python3 -m quantserve.bench.decode --models 8b --quants int8 --kernels "$k8" "${common[@]}" --out "$out/decode-8b-int8.json" 2>&1 | tail -n 4 | tee -a "$out/bench.txt"
timeout 130 python3 -m quantserve.bench.decode --models 8b --quants int4 --kernels "$k4" "${common[@]}" --out "$out/decode-8b-int4.json" 2>&1 | tail -n 4 | tee -a "$out/bench.txt"
timeout 120 python3 -m quantserve.bench.decode --models 8b --quants none "${common[@]}" --out "$out/decode-8b-fp16.json" 2>&1 | tail -n 4 | tee -a "$out/bench.txt"
timeout 75 python3 -m quantserve.bench.decode --models 1b --quants int8 --kernels "$k1" "${common[@]}" --out "$out/decode-1b-int8.json" 2>&1 | tail -n 4 | tee -a "$out/bench.txt"
for i in $(seq 60); do [ -f /tmp/ggufs.done ] && break; sleep 2; done
tail -n 8 /tmp/ggufs.log >> "$out/bench.txt"
for m in llama-3.1-8b-Q8_0 llama-3.1-8b-Q4_K_M llama-3.2-1b-Q8_0; do
  [ -f "/tmp/$m.gguf" ] && timeout 45 /tmp/llama-cpp/bin/llama-bench -m "/tmp/$m.gguf" -p 512 -n 128 -fa 1 -ngl 99 -r 2 -o md \
      2>/dev/null | grep -E "^\|" | tee -a "$out/bench.txt"
done
f16=$(ls /tmp/gguf-llama-3.1-8b/*.gguf 2>/dev/null | head -n 1)
[ -n "$f16" ] && timeout 45 /tmp/llama-cpp/bin/llama-bench -m "$f16" -p 512 -n 128 -fa 1 -ngl 99 -r 2 -o md 2>/dev/null \
    | grep -E "^\|" | tee -a "$out/bench.txt"
