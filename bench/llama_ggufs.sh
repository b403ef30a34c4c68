#!/usr/bin/env bash
# The GGUFs llama-bench reads, from the random checkpoints in /tmp: F16 by our converter, then
# Q8_0 and Q4_K_M by llama.cpp's own llama-quantize (waits for its build).  Writes /tmp/ggufs.done.
# $GGUF_SHAPES: the shapes (default: llama-3.1-8b llama-3.2-1b).
#   usage: bench/llama_ggufs.sh SITE_DIR
set -uo pipefail
export PYTHONPATH=$1
cd /tmp
for shape in ${GGUF_SHAPES:-llama-3.1-8b llama-3.2-1b}; do
  [ -d "/tmp/gguf-$shape" ] || python3 -m quantserve convert "/tmp/ck-$shape" -f gguf-f16 -o "/tmp/gguf-$shape" -q
  ls -l /tmp/gguf-$shape && rm -rf "/tmp/ck-$shape"  # 16 GB for the 8B: the disk holds 64
done
until [ -x /tmp/llama-cpp/bin/llama-quantize ]; do
  pgrep -f device-llama-cpp.sh > /dev/null || { echo "llama.cpp build ended without llama-quantize"; tail -n 20 /tmp/llama-cpp.log; exit 1; }
  sleep 5
done
for shape in ${GGUF_SHAPES:-llama-3.1-8b llama-3.2-1b}; do
  f16=$(ls /tmp/gguf-$shape/*.gguf | head -n 1)
  for q in Q8_0 Q4_K_M; do
    [ -f "/tmp/$shape-$q.gguf" ] || /tmp/llama-cpp/bin/llama-quantize "$f16" "/tmp/$shape-$q.gguf" $q 16 > /dev/null 2>&1 \
      || echo "llama-quantize $shape $q failed"
  done
done
ls -l /tmp/*.gguf; touch /tmp/ggufs.done
