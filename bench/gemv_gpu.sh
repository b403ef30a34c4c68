#!/usr/bin/env bash
# The batch-1 matrix-vector kernels of triton_gemv.py on the lent GPU, in three back-to-back calls
# (the machine stays warm between them and keeps /tmp, the Triton and inductor caches, and the
# detached llama.cpp build):
#   bench/gemv_gpu.sh OUT 1   install; llama.cpp's build and the GGUFs of random 8B / 1B checkpoints
#                             start detached; the GPU kernel tests; per-layer kernel race (8B: ours,
#                             the previous kernels, GemLite, fp16 at batch 1, and prompts of 512;
#                             1B at batch 1); 1B decode step profile (fp16, int8, int4) and its prompt
#   bench/gemv_gpu.sh OUT 2   llama-bench on F16 / Q8_0 / Q4_K_M (8B) and Q8_0 (1B), then in the same
#                             call our batch-1 decode: 8B fp16, int8, int4 (ours) and 1B int8, int4
#   bench/gemv_gpu.sh OUT 3   8B at batch 8 and 32 (fp16, int8, int4) and the 8B step profile with a
#                             512-token prompt per format
# Run from the repo root with .devwheels carried (the wheels the GPU image lacks; .devwheels/old/
# holds the previous triton_gemv.py for the race's "-old" kinds).
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site QUANTSERVE_HOME=/tmp/qs-home PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # log, left, decode
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
  setsid nohup bash -c "cd /tmp && for s in llama-3.1-8b llama-3.2-1b; do [ -d /tmp/gguf-\$s ] || \
      nice -n 10 python3 -m quantserve.bench.make_checkpoint --shape \$s --shape-vocab --out /tmp/ck-\$s --context 4096; done; \
      nice -n 10 bash $repo/bench/llama_ggufs.sh $site" > /tmp/ggufs.log 2>&1 < /dev/null &
  log "installed"
  # from /tmp: in the source tree `quantserve` would be the bare folder, not the installed package
  (cd /tmp && timeout 170 python3 -m pytest --import-mode=append -q -p no:cacheprovider "$repo/tests/serve/test_gpu_kernels.py" \
      "$repo/tests/serve/test_fastcore.py" -k "test_gpu_kernels or ((weight_kernels or matrix_vector) and not gemlite)") \
      > "$out/gpu-tests.log" 2>&1 || log "gpu tests: rc=$?"
  tail -n 4 "$out/gpu-tests.log" >> "$out/bench.txt"; log "tests done"
  (cd /tmp && timeout 190 python3 -m quantserve.bench.kernel_race --shapes 8b --batches 1,512 \
      --old "$repo/.devwheels/old/triton_gemv_old.py" --out "$out/race-8b.json") > "$out/race-8b.log" 2>&1 \
      || log "race 8b: rc=$?"
  log "race 8b done"
  (cd /tmp && timeout $(left 420) python3 -m quantserve.bench.kernel_race --shapes 1b --batches 1 \
      --kinds fp16,int8,int8-gemlite,int4,int4-gemlite --out "$out/race-1b.json") > "$out/race-1b.log" 2>&1 \
      || log "race 1b: rc=$?"
  log "race 1b done"
  (cd /tmp && timeout $(left 565) python3 -m quantserve.bench.step_profile --model 1b --quants int8,none,int4 \
      --prompt-len 512 --out "$out/profile-1b.json") > "$out/profile-1b.log" 2>&1 || log "profile 1b: rc=$?"
  grep -E "tok/s|prompt of" "$out/profile-1b.log" >> "$out/bench.txt"
  tail -n 3 /tmp/llama-build.out /tmp/ggufs.log >> "$out/bench.txt" 2>&1
elif [ "$phase" = 2 ]; then
  for i in $(seq 60); do [ -f /tmp/ggufs.done ] && break; sleep 2; done
  tail -n 6 /tmp/ggufs.log >> "$out/bench.txt"
  f16=$(ls /tmp/gguf-llama-3.1-8b/*.gguf 2>/dev/null | head -n 1)
  llama_bench 60 /tmp/llama-3.1-8b-Q4_K_M.gguf /tmp/llama-3.1-8b-Q8_0.gguf "$f16" /tmp/llama-3.2-1b-Q8_0.gguf
  log "llama-bench done"
  decode 110 8b-fp16-b1 --models 8b --quants none --batches 1
  decode 110 8b-int8-b1 --models 8b --quants int8 --kernels triton --batches 1
  decode 110 8b-int4-b1 --models 8b --quants int4 --kernels triton --batches 1
  decode $(left 585) 1b-int8-int4 --models 1b --quants int8,int4 --kernels triton --batches 1
else
  decode 170 8b-int8-b8-32 --models 8b --quants int8 --kernels triton --batches 8,32
  decode 150 8b-fp16-b8-32 --models 8b --quants none --batches 8,32
  decode 150 8b-int4-b8-32 --models 8b --quants int4 --kernels triton --batches 8,32
  (cd /tmp && timeout $(left 585) python3 -m quantserve.bench.step_profile --model 8b --quants int8,none,int4 \
      --steps 32 --prompt-len 512 --out "$out/profile-8b.json") > "$out/profile-8b.log" 2>&1 || log "profile 8b: rc=$?"
  grep -E "tok/s|prompt of" "$out/profile-8b.log" >> "$out/bench.txt"
fi
cat "$out/bench.txt"
