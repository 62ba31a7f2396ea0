#!/usr/bin/env bash
# Runs the GPU tests (and optional extra commands) on the GPU machine from a
# build directory built here and carried along (see docs/gpu.md).
#   tools/gpu_check.sh BUILD_DIR [TEST_FILTER]
# Writes logs to $OUT (when set) and prints a summary table last.
set -uo pipefail
build=${1:-build-cuda}
filter=${2:-}
out=${OUT:-/tmp/gpu_out}
mkdir -p "$out"
export NUCLEUS_MODELS_DIR=$PWD/models
export NUCLEUS_BIN=$PWD/$build/bin/nucleus
export NCCL_NVLS_ENABLE=0
summary=()
for t in "$build"/bin/*_gpu_test "$build"/bin/gpu_*_test; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  [ -n "$filter" ] && [[ "$name" != *$filter* ]] && continue
  start=$(date +%s%N)
  "$t" --gtest_color=no >"$out/$name.log" 2>&1
  rc=$?
  secs=$(( ($(date +%s%N) - start) / 1000000 ))
  pass=$(grep -c '^\[       OK \]' "$out/$name.log")
  fail=$(grep -c '^\[  FAILED  \] [A-Za-z]' "$out/$name.log")
  summary+=("$(printf '%-32s rc=%-3s ok=%-3s failed=%-3s %8s ms' "$name" "$rc" "$pass" "$fail" "$secs")")
  if [ $rc -ne 0 ]; then grep -E 'Failure|Expected|Which is|mismatch|error|FAILED' "$out/$name.log" | head -40; fi
  grep -E '^[a-z-]+.*(checked|compared|max )' "$out/$name.log" | head -20
done
echo "== GPU test summary =="
printf '%s\n' "${summary[@]}"
