#!/usr/bin/env bash
# One device call: GPU tests, then bench latency on dummy DeepSeek-V2-Lite and a
# 4-layer DeepSeek-V3 truncation. Logs under $OUT.
set -uo pipefail
B=${1:-build-gpu}
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu_check.sh "$B" 2>&1 | tee "$out/tests.txt" | tail -25
export NUCLEUS_LOG_LEVEL=warn
timeout 150 $B/bin/nucleus bench latency --config models/configs/deepseek-v2-lite.config.json --load-format dummy \
  --device cuda --batch-sizes 1,8,32 --input-len 1024 --output-len 32 --max-num-seqs 32 > "$out/v2lite.txt" 2>&1
tail -8 "$out/v2lite.txt"
timeout 120 $B/bin/nucleus bench latency --config models/configs/deepseek-v3.config.json --load-format dummy \
  --override num_hidden_layers=4 --device cuda --batch-sizes 1,8 --input-len 256 --output-len 16 --max-num-seqs 8 \
  > "$out/v3.txt" 2>&1
tail -6 "$out/v3.txt"
