#!/usr/bin/env bash
# One device call for the reliability work (issue #23), from a shared CUDA build
# staged with tools/stage_carry.sh and packed as build-gpu-pack/carry.tar.xz
# (tar of build-gpu-carry, xz): the GPU tests of the ops whose CUDA errors are
# now reported (NUCLEUS_OP_CUDA_CHECK), the V2-Lite decode latency, and a
# failed step on CUDA (NUCLEUS_FAULT_INJECT) served as one failed request.
#   device tool, carry ["build-gpu-pack"]: bash tools/gpu_call_reliability.sh [ctest-regex]
set -o pipefail
tar -xJf build-gpu-pack/carry.tar.xz || exit 1
B=build-gpu-carry; N=$B/bin/nucleus
export NUCLEUS_MODELS_DIR=$PWD/models NUCLEUS_LOG_LEVEL=warn
echo "== ctest"; CTEST_FILTER="${1:-sampling|splitk}" timeout 300 tools/gpu_session.sh $B ctest_some | tail -14
echo "== latency V2-Lite"
timeout 220 $N bench latency --config models/configs/deepseek-v2-lite.config.json --load-format dummy --device cuda \
  --batch-sizes 1,8,32,128 --input-len 1024 --output-len 128 > $OUT/latency_v2lite.txt 2>&1; echo "rc=$?"; tail -5 $OUT/latency_v2lite.txt
echo "== fault injection on CUDA (eager): serve, one failed step, then the same request again"
PORT=18321
NUCLEUS_FAULT_INJECT=embedding:2 $N serve --device cuda --model models/tiny-dsv3 --port $PORT --enforce-eager > $OUT/serve_fault.txt 2>&1 &
SP=$!
python3 - $PORT <<'PY' 2>&1 | tee $OUT/fault_client.txt
import sys, json, time, http.client
port = int(sys.argv[1])
for _ in range(600):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2); c.request("GET", "/health")
        if c.getresponse().status == 200: break
    except OSError: time.sleep(0.1)
case = json.load(open("models/ref/cases.json"))["tiny-dsv3"][0]
body = json.dumps({"prompt": case["prompt"], "max_tokens": 32, "temperature": 0, "ignore_eos": True})
def post():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse(); return r.status, json.loads(r.read())
s1, b1 = post(); print("first:", s1, b1.get("error", {}).get("message", "")[:160])
s2, b2 = post(); print("second:", s2, "text equals reference:", s2 == 200 and b2["choices"][0]["text"] == case["greedy_text"])
c = http.client.HTTPConnection("127.0.0.1", port, timeout=5); c.request("GET", "/metrics")
m = [l for l in c.getresponse().read().decode().splitlines() if l.startswith("nucleus_kv_blocks_used ")]
print("metrics:", m)
PY
kill $SP; wait $SP 2>/dev/null; echo "serve exit $?"
