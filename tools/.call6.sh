B=build-gpu-carry; N=$B/bin/nucleus; V2=models/configs/deepseek-v2-lite.config.json
python3 tools/random_prompts.py --num 256 --len 512 --vocab 102400 --seed 1 > /tmp/p.jsonl
echo "=== blocking, eager, 24 tokens"
CUDA_LAUNCH_BLOCKING=1 NUCLEUS_LOG_LEVEL=warn timeout 100 $N generate --config $V2 --load-format dummy --device cuda --ignore-eos --prompts /tmp/p.jsonl --max-tokens 24 --enforce-eager 2>&1 >/dev/null | tail -3
if [ "${PIPESTATUS[0]}" != 0 ]; then
  echo "=== sanitizer"
  NUCLEUS_LOG_LEVEL=warn timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 3 $N generate --config $V2 --load-format dummy --device cuda --ignore-eos --prompts /tmp/p.jsonl --max-tokens 18 --enforce-eager 2>&1 >/dev/null | grep -v "^\s*$" | head -40
fi
tools/gpu_session.sh $B ctest fp8kv 2>&1 | tail -80
cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz . 2>/dev/null && find . -type f ! -name logs.tgz -delete
