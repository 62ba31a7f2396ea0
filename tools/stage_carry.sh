#!/usr/bin/env bash
# Stages what a GPU-machine run needs from a build directory built here with
# -DNUCLEUS_CUDA=ON -DNUCLEUS_SHARED=ON into DEST (default BUILD-carry), small
# enough for the device tool's 64 MiB limit: nucleus, the GPU test binaries,
# the benchmarks named in BENCHES (default: all *_bench), the shared libraries
# (stripped; RUNPATH $ORIGIN/../lib), and the CTest files with BUILD's paths
# rewritten to DEST. Carry ["DEST"] and run tools/gpu_session.sh DEST ...
#   tools/stage_carry.sh BUILD [DEST]
set -euo pipefail
B=${1:?usage: tools/stage_carry.sh BUILD [DEST]}
D=${2:-$B-carry}
src_build=$(cd "$B" && pwd)
rm -rf "$D"
mkdir -p "$D/bin" "$D/lib"
dest_build=$(cd "$D" && pwd)
benches=${BENCHES:-$(cd "$B/bin" && ls *_bench 2>/dev/null || true)}
for f in nucleus $(cd "$B/bin" && ls *_gpu_test gpu_*_test 2>/dev/null) $benches; do
  strip --strip-unneeded -o "$D/bin/$f" "$B/bin/$f"
done
for f in "$B"/lib/*.so*; do
  [ -L "$f" ] && { cp -P "$f" "$D/lib/"; continue; }
  strip --strip-unneeded -o "$D/lib/$(basename "$f")" "$f"
done
# The kernel timeline's CUPTI, which the GPU machine may not have.
if [ -f "$B/lib/libnucleus_kernel_timeline.so" ]; then
  cupti=$(ldd "$B/lib/libnucleus_kernel_timeline.so" | awk '/libcupti/ {print $3}')
  [ -n "$cupti" ] && cp -L "$cupti" "$D/lib/"
fi
# CTest files: the ones of BUILD, pointing at DEST's binaries.
(cd "$B" && find . -name CTestTestfile.cmake -not -path "./bin/*") | while read -r f; do
  mkdir -p "$D/ctest/$(dirname "$f")"
  sed "s#$src_build/bin/#$dest_build/bin/#g" "$B/$f" > "$D/ctest/$f"
done
pwd > "$D/ctest/SOURCE_ROOT"
du -sh "$D"
