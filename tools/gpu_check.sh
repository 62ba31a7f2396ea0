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
# NCCL (tensor parallelism) lives in the Python image's nvidia packages on the
# GPU machine: point nucleus at it unless the caller did (docs/tp.md).
if [ -z "${NUCLEUS_NCCL_LIBRARY:-}" ]; then
  nccl=$(python3 -c "
import glob, os, site, sys
for p in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
    hits = sorted(glob.glob(os.path.join(p, 'nvidia', '**', 'libnccl.so.2'), recursive=True))
    if hits:
        print(hits[0]); break
" 2>/dev/null)
  [ -n "$nccl" ] && export NUCLEUS_NCCL_LIBRARY=$nccl
fi
echo "NCCL: ${NUCLEUS_NCCL_LIBRARY:-not set, the built-in search applies (comm/nccl_communicator.h)}"
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
