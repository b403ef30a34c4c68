#!/usr/bin/env bash
# The tiled weight kernels (decode batches 2-64 and prompts) on the lent GPU, against cuBLAS fp16
# and against the previous commit's kernels in the same call; two back-to-back calls (the machine
# stays warm between them and keeps /tmp and the Triton caches):
#   bench/tiles_gpu.sh OUT 1   install (this tree into /tmp/site; the previous commit's wheel,
#                              .devwheels/old/quantserve-*.whl, into /tmp/site-old); the GPU kernel
#                              tests; the per-layer race (8B layers at M = 8, 32, 512: fp16, int8,
#                              int4, dequantize-then-cuBLAS), then the previous kernels' race
#   bench/tiles_gpu.sh OUT 2   the compiled, CUDA-graphed decode tests with the Triton kernels;
#                              bench decode 8B at batch 8 and 32 (int4, int8, fp16), T4 profile;
#                              the 8B step profile with a 512-token prompt (int8, int4, fp16)
#   bench/tiles_gpu.sh OUT 3   after a change to the int4 tiles (fresh or warm machine): the GPU tests
#                              of the tiles, the race (fp16, int4) and bench decode 8B int4 and fp16
#                              at batch 8 and 32, within ~7 minutes
# Run from the repo root with .devwheels carried; OUT receives results-PHASE.tgz and bench.txt.
set -uo pipefail
dest=$(realpath -m "$1"); phase=$2; out=/tmp/tiles-$phase; mkdir -p "$out" "$dest"; repo=$PWD; site=/tmp/site; old=/tmp/site-old
export QUANTSERVE_HOME=/tmp/qs-home PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # log, left, decode
race() {  # LIMIT_S NAME SITE ARGS...
  local limit=$1 name=$2 where=$3; shift 3
  (cd /tmp && PYTHONPATH=$where:$site timeout "$limit" python3 -m quantserve.bench.kernel_race --shapes 8b \
      --out "$out/race-$name.json" "$@") > "$out/race-$name.log" 2>&1 || log "race $name: rc=$?"
  grep -E "^\| " "$out/race-$name.log" >> "$out/bench.txt"; log "race $name done"
}
if [ ! -d "$site/fastapi" ]; then  # the wheels the image lacks, once per machine
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .devwheels/*.whl \
      .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
fi
[ "$phase" != 1 ] || [ -d "$old/quantserve" ] || \
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$old" .devwheels/old/quantserve-*.whl
# this tree, always (a warm machine holds the last call's)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" . 2>&1 | grep -v WARNING
if [ "$phase" = 1 ]; then
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  PYTHONPATH=$site python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/bench.txt" 2>&1
  log "installed"
  (cd /tmp && PYTHONPATH=$site timeout 200 python3 -m pytest --import-mode=append -q -p no:cacheprovider \
      "$repo/tests/serve/test_gpu_kernels.py" "$repo/tests/serve/test_fastcore.py" \
      -k "test_gpu_kernels or (weight_kernels and not gemlite)") \
      > "$out/gpu-tests.log" 2>&1 || log "gpu tests: rc=$?"
  tail -n 4 "$out/gpu-tests.log" >> "$out/bench.txt"; log "tests done"
  race $(left 440) new $site --batches 8,32,512 --layers qkv,o,gate_up,down \
      --kinds fp16,int8,int4,int8-dense,int4-dense,int8-tiles,int4-tiles
  race $(left 585) old $old --batches 8,32,512 --kinds int8,int4  # its race has no --layers: lm_head too
elif [ "$phase" = 3 ]; then
  (cd /tmp && PYTHONPATH=$site timeout 150 python3 -m pytest --import-mode=append -q -p no:cacheprovider \
      "$repo/tests/serve/test_gpu_kernels.py" -k "tile_config or launcher or dense") > "$out/gpu-tests.log" 2>&1 \
      || log "gpu tests: rc=$?"
  tail -n 4 "$out/gpu-tests.log" >> "$out/bench.txt"; log "tests done"
  race $(left 230) new $site --batches 8,32,512 --layers qkv,o,gate_up,down --kinds fp16,int4,int4-tiles
  decode $(left 330) 8b-int4 --models 8b --quants int4 --kernels triton --batches 8,32
  decode $(left 420) 8b-fp16 --models 8b --quants none --batches 8,32
else
  (cd /tmp && PYTHONPATH=$site timeout 240 python3 -m pytest --import-mode=append -q -p no:cacheprovider \
      "$repo/tests/serve/test_fastcore.py" -k "compiled_triton_decode and not gemlite") \
      > "$out/gpu-tests-compiled.log" 2>&1 || log "compiled decode tests: rc=$?"
  tail -n 4 "$out/gpu-tests-compiled.log" >> "$out/bench.txt"; log "tests done"
  decode 150 8b-int4 --models 8b --quants int4 --kernels triton --batches 8,32
  decode 150 8b-int8 --models 8b --quants int8 --kernels triton --batches 8,32
  decode 130 8b-fp16 --models 8b --quants none --batches 8,32
  (cd /tmp && PYTHONPATH=$site timeout $(left 585) python3 -m quantserve.bench.step_profile --model 8b \
      --quants int8,int4,none --steps 16 --prompt-len 512 --out "$out/profile-8b.json") > "$out/profile-8b.log" 2>&1 \
      || log "profile 8b: rc=$?"
  grep -E "tok/s|prompt of" "$out/profile-8b.log" >> "$out/bench.txt"
fi
# the device returns at most 8 files: everything as one tarball, and the summary beside it
tar czf "$dest/results-$phase.tgz" -C "$out" . && cp "$out/bench.txt" "$dest/"; cat "$out/bench.txt"
