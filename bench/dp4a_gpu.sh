#!/usr/bin/env bash
# The batch-1 kernels with x rounded to int8 and dp4a products (server/fastcore/triton_dp4a.py) on
# the lent GPU, in two back-to-back calls (the machine stays warm between them and keeps /tmp and
# the detached llama.cpp build):
#   bench/dp4a_gpu.sh OUT 1      install; the GPU tests of the batch-1 kernels (every config, dp4a
#                                included); bench decode 8B at batch 1, int8 and int4, with the dp4a
#                                form allowed, then with QUANTSERVE_INT8_ACTIVATIONS=0 (the float forms
#                                only: the baseline, same call); the per-layer race on the 8B shape at
#                                batch 1 (fp16, the launcher's int8 / int4, each batch-1 form alone)
#   bench/dp4a_gpu.sh OUT race   install and the per-layer race alone ($KINDS, by $END s): the least device time
#   bench/dp4a_gpu.sh OUT llama  llama.cpp's build, a random 8B checkpoint and its GGUFs (F16 by us,
#                                Q8_0 / Q4_K_M by llama-quantize), detached (~10 min of the machine)
#   bench/dp4a_gpu.sh OUT 2      after those: bench decode 8B at batch 1 (fp16, int8 and int4 as served),
#                                then in the same call llama-bench on Q8_0 / Q4_K_M (waiting for the
#                                GGUFs up to 440 s in); FLOAT=1: int8 and int4 without the dp4a form too;
#                                FUSION=off,gate+residual: the fused batch-1 forms beside (bench decode --fusion)
# Run from the repo root with .devwheels and .devllama (the slimmed llama-cpp-python sdist) carried.
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # log, left, decode, llama_bench
if [ "$phase" = 1 ]; then
  install_site .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/bench.txt" 2>&1
  log "installed"
  # $SHORT=1 (little device time left): no race, and the two decode runs end by $END s (default 450);
  # with END < 450 the tests are left out too; $QUANTS (default int8,int4) the weights decoded
  end=${END:-450}; [ "${SHORT:-0}" = 1 ] || end=500
  # from /tmp: in the source tree `quantserve` would be the bare folder, not the installed package
  [ "$end" -lt 450 ] || { (cd /tmp && QUANTSERVE_HOME=/tmp/qs-tests timeout 70 python3 -m pytest --import-mode=append -q \
      -p no:cacheprovider -rfs "$repo/tests/serve/test_gpu_kernels.py" -k "matrix_vector") > "$out/gpu-tests.log" 2>&1 \
      || log "gpu tests: rc=$?"
    grep -E "^FAILED|^SKIPPED|passed|failed" "$out/gpu-tests.log" >> "$out/bench.txt"; log "tests done"; }
  QUANTSERVE_HOME=/tmp/qs-on1 decode $(left $(( SECONDS + (end - SECONDS) / 2 ))) 8b-b1-dp4a --models 8b \
      --quants ${QUANTS:-int8,int4} --kernels triton --batches 1
  (export QUANTSERVE_INT8_ACTIVATIONS=0
   QUANTSERVE_HOME=/tmp/qs-off1 decode $(left "$end") 8b-b1-float --models 8b --quants ${QUANTS:-int8,int4} --kernels triton \
       --batches 1)
  if [ "${SHORT:-0}" != 1 ]; then
    (cd /tmp && QUANTSERVE_HOME=/tmp/qs-race timeout $(left 585) python3 -m quantserve.bench.kernel_race --shapes 8b \
        --batches 1 --kinds fp16,int8,int8-gemv,int8-dp4a,int4,int4-gemv,int4-dp4a --out "$out/race-8b.json") \
        > "$out/race-8b.log" 2>&1 || log "race: rc=$?"
    sed -n '/^| layer/,$p' "$out/race-8b.log" >> "$out/bench.txt"; log "race done"
  fi
elif [ "$phase" = race ]; then  # the least device time: install, then the per-layer race alone (errors included)
  install_site
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
  log "installed"
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-race timeout $(left ${END:-170}) python3 -m quantserve.bench.kernel_race --shapes 8b \
      --batches 1 --kinds ${KINDS:-int4-gemv,int4-dp4a,int8-gemv,int8-dp4a} --out "$out/race-8b.json") \
      > "$out/race-8b.log" 2>&1 || log "race: rc=$?"
  sed -n '/^| layer/,$p' "$out/race-8b.log" >> "$out/bench.txt"; log "race done"
elif [ "$phase" = llama ]; then  # a later call: llama.cpp's build and the 8B GGUFs, detached (~10 min)
  # the GGUF writer, where an earlier script (bench/cold_start.sh) installed the package without it
  [ -d "$site/gguf" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
  [ -x /tmp/llama-cpp/bin/llama-bench ] || setsid nohup nice -n 19 bash .devwheels/device-llama-cpp.sh \
      .devllama/llama_cpp_python-0.3.36.tar.gz /tmp/llama-cpp 90 > /tmp/llama-build.out 2>&1 < /dev/null &
  # an 8B checkpoint that bench/cold_start.sh left on this machine is used as it is
  setsid nohup bash -c "cd /tmp && { [ -d /tmp/gguf-llama-3.1-8b ] || [ -f /tmp/ck-llama-3.1-8b/config.json ] \
      || nice -n 10 python3 -m quantserve.bench.make_checkpoint \
      --shape llama-3.1-8b --shape-vocab --out /tmp/ck-llama-3.1-8b --context 4096; } && \
      GGUF_SHAPES=llama-3.1-8b nice -n 10 bash $repo/bench/llama_ggufs.sh $site" > /tmp/ggufs.log 2>&1 < /dev/null &
  log "llama.cpp build and GGUFs started"
elif [ "$phase" = 2 ]; then
  # every batch-1 target of issue 20 in this one call: fp16 (int4 >= 2x it), int8 and int4 as served
  # (the dp4a form allowed, weights loaded ahead) first, while the GGUFs may still be in the making;
  # then llama-bench on Q8_0 / Q4_K_M; $FLOAT=1 adds int8 and int4 without the dp4a form
  QUANTSERVE_HOME=/tmp/qs-on2 decode $(left 300) 8b-b1-dp4a --models 8b --quants none,int8,int4 --kernels triton \
      --batches 1 --fusion ${FUSION:-default}
  until [ -f /tmp/ggufs.done ] || [ "$SECONDS" -gt 440 ]; do sleep 2; done
  tail -n 6 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 60 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf
  log "llama-bench done"
  [ "${FLOAT:-0}" != 1 ] || (export QUANTSERVE_INT8_ACTIVATIONS=0
   QUANTSERVE_HOME=/tmp/qs-off decode $(left 585) 8b-b1-float --models 8b --quants int8,int4 --kernels triton --batches 1)
else
  echo "dp4a_gpu.sh: unknown phase '$phase' (1, race, llama or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
