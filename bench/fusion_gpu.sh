#!/usr/bin/env bash
# Batch-1 decode with the norms, the gate and the residual adds inside the int8 / int4 weight
# kernels (server/fastcore/fused.py) against the same build with them as separate kernels, and
# against llama.cpp's llama-bench, in two back-to-back calls on the lent GPU (the machine stays warm
# between them and keeps /tmp):
#   bench/fusion_gpu.sh OUT 1   (~9.5 min on a fresh machine; .devwheels and .devllama carried)
#     detached on cores 8-15: llama.cpp's build, the random 8B / 1B checkpoints and their GGUFs
#     (F16 by our converter, Q8_0 / Q4_K_M by llama-quantize); on cores 0-7:
#     the GPU tests of the fused kernels and ops (every matrix-vector config in each fused form: norm,
#     norm + gate, residual; the ops before and after the launcher's choice, inside a CUDA graph; the
#     kernel count of a one-token step) and the compiled, CUDA-graphed decode against eager; then
#     bench decode at batch 1 under the T4 profile, --fusion on,off: 8B int8 (with a 16-step kernel
#     profile), 8B int4, and 8B fp16; the batch-1 path's quality (bench/quality.py --decode: default
#     model and 1B shape, int8 and int4 against fp16); the per-layer race at batch 1 (8B: fp16, int8,
#     int4 as the launcher chooses, and int4's matrix-vector kernel with fp32 and with packed fp16
#     products alone).
#   bench/fusion_gpu.sh OUT 2   (~5 min, the machine call 1 left warm) llama-bench on the 8B's Q8_0
#     and Q4_K_M GGUFs and the 1B's Q8_0, then in the same call bench decode at batch 1: 8B int8 and
#     int4 as served (FUSION=on for all the fused forms), 1B int8 --fusion on,off: the ratios
#     against baselines measured in that call.  It waits GGUF_WAIT x 2 s (default 60 s) for the
#     GGUFs call 1 started; llama.cpp's build took until ~8 min after call 1 began on an H100.
# OUT gets results.tgz and bench.txt.  Run from the repo root.
set -uo pipefail
# END: the seconds the first call may take; a smaller one skips its quality and race parts
dest=$(realpath -m "$1"); phase=${2:-1}; end=${END:-575}; out=/tmp/fusion-$phase; mkdir -p "$out" "$dest"; repo=$PWD; site=/tmp/site
# every fused form (server/fastcore/fused.py) for the tests and quality runs here; bench decode sets them per run (--fusion)
export QUANTSERVE_HOME=/tmp/qs-home PYTHONUNBUFFERED=1 QUANTSERVE_FUSED_DECODE=1
source "$repo/bench/gpu_lib.sh"  # log, left, decode
taskset -cp 0-7 $$ > /dev/null  # this script and what it starts on cores 0-7; the detached jobs on 8-15
[ -d "$site/fastapi" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .devwheels/*.whl \
    .devwheels/llama/gguf-*.whl .devwheels/llama/diskcache-*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" . 2>&1 | grep -v WARNING
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
PYTHONPATH=$site python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/bench.txt" 2>&1
log "installed"
if [ "$phase" = 1 ] && [ "${LLAMA:-1}" = 1 ]; then  # LLAMA=0: no second call follows
  [ -x /tmp/llama-cpp/bin/llama-bench ] || setsid nohup taskset -c 8-15 nice -n 19 bash .devwheels/device-llama-cpp.sh \
      .devllama/llama_cpp_python-0.3.36.tar.gz /tmp/llama-cpp 90 > /tmp/llama-build.out 2>&1 < /dev/null &
  # the checkpoints on the CPU (a GPU init would share the GPU with the runs measured here)
  setsid nohup taskset -c 8-15 nice -n 10 bash -c "cd /tmp && export CUDA_VISIBLE_DEVICES= PYTHONPATH=$site; \
      for s in llama-3.1-8b llama-3.2-1b; do [ -d /tmp/gguf-\$s ] || python3 -m quantserve.bench.make_checkpoint \
      --shape \$s --shape-vocab --out /tmp/ck-\$s --context 4096; done; bash $repo/bench/llama_ggufs.sh $site" \
      > /tmp/ggufs.log 2>&1 < /dev/null &
elif [ "$phase" = 2 ]; then
  for i in $(seq ${GGUF_WAIT:-30}); do [ -f /tmp/ggufs.done ] && break; sleep 2; done
  tail -n 8 /tmp/ggufs.log >> "$out/bench.txt"
  llama_bench 45 /tmp/llama-3.1-8b-Q8_0.gguf /tmp/llama-3.1-8b-Q4_K_M.gguf /tmp/llama-3.2-1b-Q8_0.gguf
  log "llama-bench done"
  decode $(left 170) 8b-int8 --models 8b --quants int8 --kernels triton --batches 1 --fusion ${FUSION:-default}
  decode $(left 240) 8b-int4 --models 8b --quants int4 --kernels triton --batches 1 --fusion ${FUSION:-default}
  decode $(left 300) 1b-int8 --models 1b --quants int8 --kernels triton --batches 1 --fusion on,off
  tar czf "$dest/results.tgz" -C "$out" . && cp "$out/bench.txt" "$dest/"; cat "$out/bench.txt"; exit 0
fi
(cd /tmp && PYTHONPATH=$site timeout 240 python3 -m pytest --import-mode=append -q -p no:cacheprovider -rf \
    "$repo/tests/serve/test_gpu_kernels.py" "$repo/tests/serve/test_gemv_forms.py" "$repo/tests/serve/test_fastcore.py" \
    -k "fused or fewer_kernels or matrix_vector or disagrees or launcher or (compiled_triton_decode and not gemlite)") \
    > "$out/gpu-tests.log" 2>&1 || log "gpu tests: rc=$?"
grep -E "^FAILED|passed|failed" "$out/gpu-tests.log" >> "$out/bench.txt"; log "tests done"
by() { echo $(( $1 < end ? $1 : end )); }  # a mark, or END if that comes first
decode $(left $(by 330)) 8b-int8 --models 8b --quants int8 --kernels triton --batches 1 --fusion on,off --profile-steps 16
decode $(left $(by 420)) 8b-int4 --models 8b --quants int4 --kernels triton --batches 1 --fusion on,off
decode $(left $(by 470)) 8b-fp16 --models 8b --quants none --batches 1
# quality of the batch-1 path as served (fused forms, int4's packed products if chosen), one token a step
for args in "--weights int8" "--weights int4" "--shape 1b --weights int8" "--shape 1b --weights int4"; do
  [ $SECONDS -lt $(( end - 55 )) ] || { log "quality $args: no time left"; break; }
  (cd /tmp && PYTHONPATH=$site timeout $(left $(( end - 45 ))) python3 -m quantserve.bench.quality $args --decode --windows 4 \
      --length 128) >> "$out/quality.txt" 2>&1 || log "quality $args: rc=$?"
done
grep -E '"(model|weights|top1_agreement|ppl_change_pct|max_abs_logit_diff)"' "$out/quality.txt" >> "$out/bench.txt"
if [ $SECONDS -lt $(( end - 95 )) ]; then
  (cd /tmp && PYTHONPATH=$site timeout $(left $(( end - 30 ))) python3 -m quantserve.bench.kernel_race --shapes 8b --batches 1 \
      --kinds fp16,int8,int8-gemv,int4,int4-gemv,int4-halfdot --out "$out/race-8b.json") > "$out/race-8b.log" 2>&1 \
      || log "race: rc=$?"
  grep -E "^\| " "$out/race-8b.log" >> "$out/bench.txt"; log "race done"
else log "race: no time left"; fi
# the device returns at most 8 files: everything as one tarball, and the summary beside it
tar czf "$dest/results.tgz" -C "$out" . && cp "$out/bench.txt" "$dest/"; cat "$out/bench.txt"
