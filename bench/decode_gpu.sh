#!/usr/bin/env bash
# Our fast engine's decode (T4 profile) against llama.cpp's own llama-bench, in two back-to-back
# calls on the lent GPU (the machine stays warm between them and keeps /tmp):
#   bench/decode_gpu.sh OUT 1   install; llama.cpp's build and the GGUFs of a random 8B / 1B
#                               checkpoint start detached; the GemLite GPU tests; 8B fp16 and 8B int8
#                               (ours) at batch 1, 8, 32
#   bench/decode_gpu.sh OUT 2   llama-bench on the F16, Q8_0 and Q4_K_M GGUFs of the same shapes, then
#                               in the same call 8B fp16 and int8 at batch 1 again (compile caches
#                               warm from call 1), 8B int4 (GemLite) at 1, 8, 32 and 1B int8 at 1:
#                               the batch-1 ratios against baselines measured in that call
# Run from the repo root with .devwheels carried (the wheels the GPU image lacks).
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site QUANTSERVE_HOME=/tmp/qs-home
common=(--batches 1,8,32 --generate-batches '' --new-tokens 128 --gpu-profile t4)
decode() {  # LIMIT_S NAME ARGS...: one bench decode run, its last lines into bench.txt
  local limit=$1 name=$2; shift 2
  (cd /tmp && timeout "$limit" python3 -m quantserve.bench.decode "${common[@]}" "$@" --out "$out/decode-$name.json") \
      > "$out/decode-$name.log" 2>&1 || echo "decode $name: rc=$?" >> "$out/bench.txt"
  grep -E "tok/s|error|fit check|weights ready|batch [0-9]+:" "$out/decode-$name.log" | tail -n 12 >> "$out/bench.txt"
}
if [ "$phase" = 1 ]; then
  if [ ! -d "$site/quantserve" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .devwheels/*.whl \
        .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" .
  fi
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  python3 -c "import torch, triton, gemlite; print('torch', torch.__version__, 'triton', triton.__version__, 'gemlite', gemlite.__version__)" \
      >> "$out/bench.txt" 2>&1
  [ -x /tmp/llama-cpp/bin/llama-bench ] || setsid nohup nice -n 19 bash .devwheels/device-llama-cpp.sh \
      .devwheels/llama/llama_cpp_python-0.3.36.tar.gz /tmp/llama-cpp 90 > /tmp/llama-build.out 2>&1 < /dev/null &
  # checkpoints, F16 GGUFs (ours), then Q8_0 / Q4_K_M (llama-quantize, once built): all detached
  setsid nohup bash -c "cd /tmp && for s in llama-3.1-8b llama-3.2-1b; do [ -d /tmp/gguf-\$s ] || \
      python3 -m quantserve.bench.make_checkpoint --shape \$s --shape-vocab --out /tmp/ck-\$s --context 4096; done; \
      bash $repo/bench/llama_ggufs.sh $site" > /tmp/ggufs.log 2>&1 < /dev/null &
  # from /tmp: in the source tree `quantserve` would be the bare folder, not the installed package
  (cd /tmp && timeout 200 python3 -m pytest --import-mode=append -q -p no:cacheprovider "$repo/tests/serve/test_fastcore.py" -k gemlite) \
      > "$out/gpu-tests.log" 2>&1 || echo "gpu tests: rc=$?" >> "$out/bench.txt"
  tail -n 3 "$out/gpu-tests.log" >> "$out/bench.txt"
  decode 170 8b-fp16 --models 8b --quants none
  decode $((590 - SECONDS)) 8b-int8-triton --models 8b --quants int8 --kernels triton
else
  for i in $(seq 90); do [ -f /tmp/ggufs.done ] && break; sleep 2; done
  tail -n 8 /tmp/ggufs.log >> "$out/bench.txt"
  f16=$(ls /tmp/gguf-llama-3.1-8b/*.gguf 2>/dev/null | head -n 1)
  for m in /tmp/llama-3.1-8b-Q4_K_M.gguf /tmp/llama-3.1-8b-Q8_0.gguf "$f16" /tmp/llama-3.2-1b-Q8_0.gguf; do
    [ -f "$m" ] && timeout 60 /tmp/llama-cpp/bin/llama-bench -m "$m" -p 0 -n 128 -fa 1 -ngl 99 -r 3 -o md \
        2>/dev/null | grep -E "^\|" >> "$out/bench.txt"
  done
  decode 80 8b-fp16-b1 --models 8b --quants none --batches 1
  decode 80 8b-int8-triton-b1 --models 8b --quants int8 --kernels triton --batches 1
  decode 260 8b-int4-gemlite --models 8b --quants int4 --kernels gemlite --batches 1,8,32
  decode $((590 - SECONDS)) 1b-int8-triton --models 1b --quants int8 --kernels triton
fi
cat "$out/bench.txt"
