#!/usr/bin/env bash
# Long prompts' int8/int4 weights dequantized ahead on a second stream (server/fastcore/dequant_ahead.py)
# on the lent GPU, in one call, with its baselines measured in the same process:
#   bench/dequant_ahead_gpu.sh OUT   install; the GPU tests of the ring (bits against the in-line copy,
#                                    eager and in CUDA graphs; a core's prompt with and without) and of
#                                    the launcher's prompt paths; the step profile of the 8B (fp16, int8,
#                                    int4) with its eager 512-token prompt and the prompt steps of 256, 512
#                                    and 2,048 tokens replayed from CUDA graphs, int8/int4 with the copies
#                                    ahead and in line (the launcher's tiles or copies)
# Run from the repo root with .devwheels carried; ends by ~580 s.
set -uo pipefail
out=$(realpath -m "$1"); mkdir -p "$out"; repo=$PWD; site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1
source "$repo/bench/gpu_lib.sh"  # install_site, log, left, gpu_tests, step_profile
install_site
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) > "$out/bench.txt"
log "installed"
gpu_tests 150 "dequant_ahead or dense or launcher_matches or prompt_tile" \
    "$repo/tests/serve/test_dequant_ahead.py" "$repo/tests/serve/test_gpu_kernels.py"
step_profile $(left 580) prompts --quants none,int8,int4 --kernel triton --steps 8 --prompt-len 512 \
    --graph-prompts 256,512,2048
cat "$out/bench.txt"
