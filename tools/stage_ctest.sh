#!/usr/bin/env bash
# Copies BUILD's CTest files into BUILD/bin/ctest (which travels with the
# binaries to the GPU machine), recording the source root so that
# tools/gpu_session.sh can rewrite the absolute paths there.
#   tools/stage_ctest.sh BUILD
set -euo pipefail
B=${1:?usage: tools/stage_ctest.sh BUILD}
dest=$B/bin/ctest
rm -rf "$dest"
mkdir -p "$dest"
(cd "$B" && find . -name CTestTestfile.cmake -not -path "./bin/*") | while read -r f; do
  mkdir -p "$dest/$(dirname "$f")"
  cp "$B/$f" "$dest/$f"
done
pwd > "$dest/SOURCE_ROOT"
