#!/usr/bin/env bash
# int4's batch-1 kernel with its tiles by group (triton_gemv._grouped_dot4_sums: a group's scale and
# zero point loaded once a thread) on the lent GPU, in two back-to-back calls (the machine stays warm
# between them and keeps /tmp):
#   bench/grouped_gpu.sh OUT 1   install; the per-layer race of the 8B at batch 1 (fp16, int4 as the
#                                launcher chooses, the per-word dp4a form, the form by groups); the GPU
#                                tests of the batch-1 kernels (every config and fused form) and the
#                                wgmma prompt kernels; bench decode 8B int4 at batch 1 tuned at start-up
#                                with the form among the candidates and without it (the baseline, same call)
#   bench/grouped_gpu.sh OUT 2   the step profile of the 8B (fp16, int8, int4; T4 profile): batch-1 decode
#                                and the prompt steps replayed from CUDA graphs (256, 512, 2,048 tokens),
#                                every shape tuned on this machine; its rows merged into a copy of the
#                                shipped tables
# Run from the repo root with .devwheels carried.  Phase 1 ends by ~480 s, phase 2 by ~400 s.
set -uo pipefail
out=$(realpath -m "$1"); phase=$2; mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, log, left, decode, gpu_tests, step_profile
install_site; (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
log "installed"
if [ "$phase" = 1 ]; then
  (cd /tmp && QUANTSERVE_HOME=/tmp/qs-race timeout $(left 90) python3 -m quantserve.bench.kernel_race --shapes 8b \
      --batches 1 --kinds fp16,int4,int4-dp4a,int4-grouped --out "$out/race-b1.json") > "$out/race-b1.log" 2>&1 \
      || log "race: rc=$?"
  grep -E "M=|copy bandwidth|rror" "$out/race-b1.log" >> "$out/bench.txt"; log "race done"
  gpu_tests $(left 250) "every_matrix_vector_config or large_activations or wgmma or by_groups or fused_form or split_k" \
      "$repo/tests/serve/test_gpu_kernels.py" "$repo/tests/serve/test_gemv_forms.py"
  QUANTSERVE_KERNEL_TABLES=0 QUANTSERVE_INT4_GROUPED=1 QUANTSERVE_HOME=/tmp/qs-g1 decode $(left 370) 8b-int4-grouped \
      --models 8b --quants int4 --kernels triton --batches 1
  QUANTSERVE_KERNEL_TABLES=0 QUANTSERVE_INT4_GROUPED=0 QUANTSERVE_HOME=/tmp/qs-g0 decode $(left 480) 8b-int4-per-word \
      --models 8b --quants int4 --kernels triton --batches 1
  rm -f "$out"/race-*.log "$out"/decode-*.log
elif [ "$phase" = 2 ]; then
  step_profile $(left 330) all --quants none,int8,int4 --kernel triton --steps 8 --prompt-len 512 \
      --graph-prompts 256,512,2048 --save-choices "$out/choices.json"
  cp -r "$repo/server/fastcore/kernel_tables" "$out/tables"
  (cd /tmp && timeout $(left 380) python3 -m quantserve.bench.kernel_table \
      --gpu "$(python3 -c 'import torch; print(torch.cuda.get_device_name())')" --out "$out/tables" "$out/choices.json") \
      >> "$out/bench.txt" 2>&1 || log "kernel_table: rc=$?"
  rm -f "$out"/profile-*.log
else
  echo "grouped_gpu.sh: unknown phase '$phase' (1 or 2)" >&2; exit 2
fi
cat "$out/bench.txt"
