#!/usr/bin/env bash
# First of two back-to-back calls on the lent GPU (the second is bench/decode_gpu.sh OUT 2):
# the per-layer kernel race (ours, GemLite, bitsandbytes) with every Triton kernel that ran
# recompiled for sm_75, then the GPU tests of the weight kernels.  Detached meanwhile: llama.cpp's
# tools (llama-bench, llama-quantize) and the GGUFs of random 8B / 1B checkpoints for the second call.
#   usage (repo root on the GPU machine, .devwheels carried): bench/kernels_gpu.sh OUT_DIR
set -euo pipefail
out=$(realpath -m "$1"); mkdir -p "$out"; repo=$PWD; site=/tmp/site
if [ ! -d "$site/quantserve" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .devwheels/*.whl \
      .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" .
fi
export PYTHONPATH=$site QUANTSERVE_HOME=/tmp/qs-home
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
[ -x /tmp/llama-cpp/bin/llama-bench ] || setsid nohup nice -n 19 bash .devwheels/device-llama-cpp.sh \
    .devwheels/llama/llama_cpp_python-0.3.36.tar.gz /tmp/llama-cpp 90 > /tmp/llama-build.out 2>&1 < /dev/null &
# checkpoints are made on the GPU: before anything there is timed
for shape in llama-3.1-8b llama-3.2-1b; do
  [ -d "/tmp/ck-$shape" ] || [ -d "/tmp/gguf-$shape" ] || (cd /tmp && python3 -m quantserve.bench.make_checkpoint --shape "$shape" --shape-vocab \
      --out "/tmp/ck-$shape" --context 4096) 2>&1 | tail -n 1 | tee -a "$out/gpu.txt"
done
setsid nohup bash bench/llama_ggufs.sh "$site" > /tmp/ggufs.log 2>&1 < /dev/null &
(cd /tmp && timeout 330 python3 -m quantserve.bench.kernels --shapes 8b,1b --batches 1,8,32,512 --sass sm_75 \
    --out "$out/kernels.json") > "$out/kernels.log" 2>&1 || echo "bench kernels: rc=$?" | tee -a "$out/gpu.txt"
if [ $SECONDS -lt 440 ]; then  # the tests only in the time left of a 10-minute call
  # from /tmp: in the source tree `quantserve` would be the bare folder, not the installed package
  (cd /tmp && timeout $((550 - SECONDS)) python3 -m pytest --import-mode=append -q -p no:cacheprovider "$repo/tests/serve/test_fastcore.py" \
      -k "weight_kernels or matrix_vector or compiled_triton") > "$out/gpu-tests.log" 2>&1 \
      || echo "gpu tests: rc=$?" | tee -a "$out/gpu.txt"
fi
tail -n 3 "$out/gpu-tests.log" /tmp/ggufs.log | tee -a "$out/gpu.txt"
