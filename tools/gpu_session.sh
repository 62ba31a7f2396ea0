#!/usr/bin/env bash
# One device call that runs the named steps on the GPU machine, from a build
# built here (cmake -DNUCLEUS_CUDA=ON -DNUCLEUS_SHARED=ON), staged by
# tools/stage_carry.sh and carried as ["BUILD-carry"] (see docs/gpu.md):
#   tools/gpu_session.sh BUILD-carry STEP [STEP ...]
# Steps:
#   ctest      ctest -L gpu over the CTest files staged by tools/stage_carry.sh (CTEST_EXCLUDE: a -E regex)
#   latency    bench latency, dummy DeepSeek-V2-Lite and a 4-layer FP8 DeepSeek-V3, batch 1,8,32,128 @ 1024/128
#   beforeafter the latency step's runs with the nucleus of $BEFORE (a staged BUILD-carry of the previous
#              version) and this build's, alternating before/after BA_ROUNDS times (default 1; same machine, same call)
#   ttft       single-prompt TTFT at 128..3072 tokens: token graphs, eager, eager-pad
#   graphs     decode step at batch 1, 8, 64: CUDA graphs against --enforce-eager
#   profile    per-op device time of eager decode steps at batch 1 and 32 (NUCLEUS_PROFILE_OPS=1)
#   generate   nucleus generate, 256 prompts x 512 tokens -> 256, and prefill with a 90% prefix hit vs none
#   serve      nucleus serve (dummy V2-Lite, --skip-tokenizer-init) + bench serve at concurrency 1, 8, 32, 64
#   fp8kv      FP8 KV cache: GPU tests, decode attention bf16 vs fp8, bench serve at concurrency 64 with each
#   skinny     skinny decode GEMM: its GPU test, skinny_gemm_bench (SKINNY_SWEEP=1: the slice sweep), and
#              decode latency with NUCLEUS_SKINNY=0, with NUCLEUS_PDL=0 and the default (dummy V2-Lite,
#              4-layer FP8 V3)
#   moedecode  fused MoE decode kernel: moe_gpu_test's Decode* tests, moe_bench --decode (cuda_decode beside
#              cuda_grouped at T = 1..16), and decode latency with NUCLEUS_MOE_DECODE=0 and the default
#              (dummy V2-Lite, 4-layer FP8 V3)
#   widths     width builds: decode step per width, MLA front end plain / fused / lean, V2-Lite and V3 (4 layers)
# Full logs go to $OUT; a short summary is printed per step.
set -uo pipefail
B=${1:?usage: tools/gpu_session.sh BUILD STEP...}
shift
out=${OUT:-/tmp/gpu_out}
mkdir -p "$out"
N=$B/bin/nucleus
V2=models/configs/deepseek-v2-lite.config.json
V3=models/configs/deepseek-v3.config.json
export NUCLEUS_LOG_LEVEL=${NUCLEUS_LOG_LEVEL:-warn}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpu.txt"

step_ctest() {
  local dir=$B/ctest
  [ -d "$dir" ] || { echo "no $dir: run tools/stage_carry.sh here first"; return 1; }
  local src; src=$(cat "$dir/SOURCE_ROOT")
  find "$dir" -name CTestTestfile.cmake -exec sed -i "s#$src#$PWD#g" {} +
  ctest --test-dir "$dir" -L gpu ${CTEST_EXCLUDE:+-E "$CTEST_EXCLUDE"} --output-on-failure --timeout 400 \
    > "$out/ctest.txt" 2>&1
  local rc=$?
  grep -E "tests passed|Test +#|Total Test time" "$out/ctest.txt" | tail -30
  return $rc
}

# ctest restricted by the regex in $CTEST_FILTER (e.g. "engine|reference"), $CTEST_JOBS at once (default 1).
step_ctest_some() {
  local dir=$B/ctest src; src=$(cat "$dir/SOURCE_ROOT")
  find "$dir" -name CTestTestfile.cmake -exec sed -i "s#$src#$PWD#g" {} +
  ctest --test-dir "$dir" -L gpu -R "${CTEST_FILTER:-.}" -j "${CTEST_JOBS:-1}" --output-on-failure --timeout 400 \
    > "$out/ctest_some.txt" 2>&1
  local rc=$?
  grep -E "tests passed|Test +#|Failure|Which is|step [0-9]" "$out/ctest_some.txt" | head -40
  return $rc
}

step_latency() {
  timeout 280 "$N" bench latency --config $V2 --load-format dummy --device cuda --batch-sizes 1,8,32,128 \
    --input-len 1024 --output-len 128 > "$out/latency_v2lite.txt" 2>&1
  tail -7 "$out/latency_v2lite.txt"
  timeout 250 "$N" bench latency --config $V3 --load-format dummy --override num_hidden_layers=4 --device cuda \
    --batch-sizes 1,8,32,128 --input-len 1024 --output-len 128 > "$out/latency_v3_4l.txt" 2>&1
  tail -7 "$out/latency_v3_4l.txt"
}

step_beforeafter() {
  [ -x "${BEFORE:-}/bin/nucleus" ] || { echo "BEFORE=$BEFORE has no bin/nucleus"; return 1; }
  local v2=(bench latency --config $V2 --load-format dummy --device cuda --batch-sizes 1,8,32,128
            --input-len 1024 --output-len 128)
  local v3=(bench latency --config $V3 --load-format dummy --override num_hidden_layers=4 --device cuda
            --batch-sizes 1,8,32,128 --input-len 1024 --output-len 128)
  for round in $(seq 1 ${BA_ROUNDS:-1}); do
    for which in before after; do
      local bin=$N; [ $which = before ] && bin=$BEFORE/bin/nucleus
      timeout 280 "$bin" "${v2[@]}" > "$out/ba_v2lite_${which}_$round.txt" 2>&1
      echo "-- V2-Lite $which (round $round)"; tail -5 "$out/ba_v2lite_${which}_$round.txt"
      timeout 250 "$bin" "${v3[@]}" > "$out/ba_v3_4l_${which}_$round.txt" 2>&1
      echo "-- V3 4 layers $which (round $round)"; tail -5 "$out/ba_v3_4l_${which}_$round.txt"
    done
  done
}

step_ttft() {
  local common=(bench latency --config $V2 --load-format dummy --device cuda --batch-sizes 1
                --input-len 128,512,1024,2048,3072 --output-len 2 --num-iters 5 --max-num-seqs 8)
  timeout 150 "$N" "${common[@]}" > "$out/ttft_graphs.txt" 2>&1; echo "-- token graphs"; tail -6 "$out/ttft_graphs.txt"
  NUCLEUS_TOKEN_GRAPH_SIZES= timeout 150 "$N" "${common[@]}" > "$out/ttft_eager.txt" 2>&1
  echo "-- eager"; tail -6 "$out/ttft_eager.txt"
  NUCLEUS_TOKEN_GRAPH_EAGER_PAD=1 timeout 150 "$N" "${common[@]}" > "$out/ttft_eager_pad.txt" 2>&1
  echo "-- eager-pad"; tail -6 "$out/ttft_eager_pad.txt"
}

step_graphs() {
  local common=(bench latency --config $V2 --load-format dummy --device cuda --batch-sizes 1,8,64
                --input-len 1024 --output-len 64 --num-iters 2)
  timeout 200 "$N" "${common[@]}" > "$out/decode_graphs.txt" 2>&1; echo "-- decode graphs"; tail -4 "$out/decode_graphs.txt"
  timeout 200 "$N" "${common[@]}" --enforce-eager > "$out/decode_eager.txt" 2>&1
  echo "-- enforce-eager"; tail -4 "$out/decode_eager.txt"
}

# Per-op device time of eager decode (NUCLEUS_PROFILE_OPS=1) at batch 1 and 32
# against the step time: what the step spends in kernels, and what in launches.
step_profile() {
  for b in 1 32; do
    NUCLEUS_PROFILE_OPS=1 timeout 150 "$N" bench latency --config $V2 --load-format dummy --device cuda \
      --batch-sizes $b --input-len 128 --output-len 64 --enforce-eager > "$out/profile_b$b.txt" 2>&1
    echo "-- batch $b (eager, profiled)"; tail -40 "$out/profile_b$b.txt"
  done
}

step_generate() {
  python3 tools/random_prompts.py --num 256 --len 512 --vocab 102400 --seed 1 > "$out/p_random.jsonl"
  python3 tools/random_prompts.py --num 256 --len 512 --vocab 102400 --seed 2 --shared-prefix 464 > "$out/p_prefix.jsonl"
  local g=(generate --config $V2 --load-format dummy --device cuda --ignore-eos --temperature 0)
  NUCLEUS_LOG_LEVEL=info timeout 200 "$N" "${g[@]}" --prompts "$out/p_random.jsonl" --max-tokens 256 \
    > /dev/null 2> "$out/generate_256x512x256.txt"
  echo "-- 256 x 512 -> 256"; grep "generate:" "$out/generate_256x512x256.txt"
  for bs in 16 64; do
    NUCLEUS_LOG_LEVEL=info timeout 120 "$N" "${g[@]}" --block-size $bs --prompts "$out/p_random.jsonl" --max-tokens 1 \
      > /dev/null 2> "$out/prefill_nohit_bs$bs.txt"
    echo "-- prefill, no prefix hit, block $bs"; grep "generate:" "$out/prefill_nohit_bs$bs.txt"
  done
  NUCLEUS_LOG_LEVEL=info timeout 120 "$N" "${g[@]}" --block-size 16 --prompts "$out/p_prefix.jsonl" --max-tokens 1 \
    > /dev/null 2> "$out/prefill_hit90.txt"
  echo "-- prefill, 464 of 512 tokens shared (90.6%), block 16"; grep "generate:" "$out/prefill_hit90.txt"
}

# SERVE_ARGS: extra serve flags; SERVE_CONC: concurrencies (default 1 8 32 64);
# SERVE_TAG: suffix of the log names.
step_serve() {
  local port=18000 tag=${SERVE_TAG:-}
  "$N" serve --config $V2 --load-format dummy --device cuda --skip-tokenizer-init --port $port ${SERVE_ARGS:-} \
    > "$out/serve$tag.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do
    python3 - "$port" <<'PY' && break
import sys, urllib.request
try: urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1); sys.exit(0)
except Exception: sys.exit(1)
PY
    sleep 0.5
  done
  grep -E "engine:" "$out/serve$tag.log"
  for c in ${SERVE_CONC:-1 8 32 64}; do
    local n=$(( c < 8 ? 8 : 4 * c ))
    timeout 150 "$N" bench serve --base-url http://127.0.0.1:$port --num-prompts $n --max-concurrency $c \
      --random-input-len 1024 --random-output-len 256 --ignore-eos --result-json "$out/serve${tag}_c$c.json" \
      > "$out/serve${tag}_c$c.txt" 2>&1
    echo "-- concurrency $c ($n prompts) $tag"; grep -E "throughput|Mean|Median|P99" "$out/serve${tag}_c$c.txt" | head -20
  done
  kill -TERM $pid; wait $pid
}

# FP8 KV cache: its GPU tests, decode attention bf16 vs fp8, bench serve at concurrency 64 with each.
step_fp8kv() {
  CTEST_FILTER="fp8" step_ctest_some
  timeout 150 "$B/bin/mla_decode_bench" --kv-cache-dtype both > "$out/mla_decode_fp8.txt" 2>&1; tail -20 "$out/mla_decode_fp8.txt"
  for d in bf16 fp8; do SERVE_TAG=_$d SERVE_CONC=64 SERVE_ARGS="--kv-cache-dtype $d" step_serve; done
}

# Width builds (NUCLEUS_WIDTH_BUILDS): decode step time per width with the MLA
# front end plain (0), fused where it fits (1) and lean (lean), dummy V2-Lite
# and 4-layer V3 (bf16: the builds read bf16 weights), graph sizes = the
# batch sizes; the first run starts from an empty kernel cache (cold), the
# others load it (warm). WIDTH_BATCHES overrides the batch sizes, WIDTH_MODELS
# the models (default "v2lite v3_4l").
step_widths() {
  local bs=${WIDTH_BATCHES:-1,2,4,8,16,32,64,128}
  local cache; cache=$(mktemp -d)
  for cfg in ${WIDTH_MODELS:-v2lite v3_4l}; do
    local args=(bench latency --load-format dummy --device cuda --batch-sizes $bs --cuda-graph-sizes $bs
                --max-num-seqs 128 --input-len 512 --output-len 32 --num-iters 1)
    if [ $cfg = v2lite ]; then args+=(--config $V2); else args+=(--config $V3 --override num_hidden_layers=4
                                                                   --override quantization_config=null); fi
    for mode in 0 1 lean; do
      NUCLEUS_KERNEL_CACHE_DIR=$cache NUCLEUS_WIDTH_BUILDS=$mode NUCLEUS_LOG_LEVEL=info timeout 240 "$N" "${args[@]}" \
        > "$out/widths_${cfg}_$mode.txt" 2>&1
      echo "-- $cfg NUCLEUS_WIDTH_BUILDS=$mode"; grep -E "width builds:|^ +[0-9]+ +[0-9]+ " "$out/widths_${cfg}_$mode.txt"
    done
  done
  rm -rf "$cache"
}

step_skinny() {
  timeout 240 "$B/bin/skinny_gemm_gpu_test" > "$out/skinny_gemm_gpu_test.txt" 2>&1
  local rc=$?
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|OK \]|Failure" "$out/skinny_gemm_gpu_test.txt" | head -20
  timeout 200 "$B/bin/skinny_gemm_bench" --sweep "${SKINNY_SWEEP:-0}" > "$out/skinny_gemm_bench.txt" 2>&1
  grep -E "^\| .*\| (cublaslt|skinny|skinny_pdl) \|" "$out/skinny_gemm_bench.txt" | grep -E "\| (1|8) \| (cublaslt|skinny)"
  for cfg in "NUCLEUS_SKINNY=0" "NUCLEUS_SKINNY=auto NUCLEUS_PDL=0" "NUCLEUS_SKINNY=auto"; do
    local tag=${cfg// /_}; tag=${tag//=/-}
    env $cfg timeout 200 "$N" bench latency --config $V2 --load-format dummy --device cuda \
      --batch-sizes ${SKINNY_BATCHES:-1,2,4,8,32} --input-len 1024 --output-len 128 > "$out/latency_v2lite_$tag.txt" 2>&1
    echo "-- V2-Lite $cfg"; tail -${SKINNY_TAIL:-7} "$out/latency_v2lite_$tag.txt"
  done
  for cfg in "NUCLEUS_SKINNY=0" "NUCLEUS_SKINNY=auto NUCLEUS_PDL=0" "NUCLEUS_SKINNY=auto"; do
    local tag=${cfg// /_}; tag=${tag//=/-}
    env $cfg timeout 150 "$N" bench latency --config $V3 --load-format dummy --override num_hidden_layers=4 \
      --device cuda --batch-sizes 1,8 --input-len 1024 --output-len 128 > "$out/latency_v3_4l_$tag.txt" 2>&1
    echo "-- V3 (4 layers, FP8) $cfg"; tail -4 "$out/latency_v3_4l_$tag.txt"
  done
  return $rc
}

step_moedecode() {
  timeout 400 "$B/bin/moe_gpu_test" --gtest_filter='MoeGpu.Decode*' > "$out/moe_decode_gpu_test.txt" 2>&1
  local rc=$?
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|OK \]|Failure" "$out/moe_decode_gpu_test.txt" | head -20
  timeout 300 "$B/bin/moe_bench" --decode > "$out/moe_bench_decode.txt" 2>&1 || rc=1
  grep -E "^\||refuses" "$out/moe_bench_decode.txt"
  for cfg in "NUCLEUS_MOE_DECODE=0" "NUCLEUS_MOE_DECODE=auto"; do
    local tag=${cfg//=/-}
    env $cfg timeout 200 "$N" bench latency --config $V2 --load-format dummy --device cuda \
      --batch-sizes 1,2,4,8,16 --input-len 1024 --output-len 128 > "$out/latency_v2lite_$tag.txt" 2>&1
    echo "-- V2-Lite $cfg"; tail -8 "$out/latency_v2lite_$tag.txt"
    env $cfg timeout 150 "$N" bench latency --config $V3 --load-format dummy --override num_hidden_layers=4 \
      --device cuda --batch-sizes 1,8,16 --input-len 1024 --output-len 128 > "$out/latency_v3_4l_$tag.txt" 2>&1
    echo "-- V3 (4 layers, FP8) $cfg"; tail -5 "$out/latency_v3_4l_$tag.txt"
  done
  return $rc
}

rc=0
for s in "$@"; do
  echo "===== $s ($(date +%T))"
  "step_$s" || rc=1
done
echo "===== done ($(date +%T)) rc=$rc"
exit $rc
