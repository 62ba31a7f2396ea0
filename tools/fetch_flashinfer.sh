#!/usr/bin/env bash
# Fetches FlashInfer's header-only kernels, with the CUTLASS and CCCL headers
# they need, from the pinned flashinfer-python wheel on PyPI (the wheel ships
# include/, cutlass/ and cccl/ under flashinfer/data/). Only headers are
# extracted; nothing is committed (the destination lives in the build tree).
#   tools/fetch_flashinfer.sh DEST_DIR
# DEST_DIR afterwards holds include/flashinfer, cutlass/include,
# cccl/{libcudacxx/include,cub,thrust}, LICENSE and VERSION. Idempotent: a
# DEST_DIR whose VERSION matches is left as it is. Exits non-zero (and leaves
# no partial DEST_DIR) when the wheel cannot be fetched, e.g. without network.
set -euo pipefail
version=0.7.2.post1
sha256=bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49
dest=${1:?usage: tools/fetch_flashinfer.sh DEST_DIR}
if [ -f "$dest/VERSION" ] && [ "$(cat "$dest/VERSION")" = "$version" ]; then
  exit 0
fi
python=${PYTHON:-python3}
cache="$dest.cache"
mkdir -p "$cache"
wheel="$cache/flashinfer_python-$version-py3-none-any.whl"
if [ ! -f "$wheel" ]; then
  "$python" -m pip download --quiet --timeout 30 --retries 1 --no-deps --only-binary=:all: -d "$cache" "flashinfer-python==$version" >&2
fi
echo "$sha256  $wheel" | sha256sum -c --quiet - >&2
tmp="$dest.tmp"
rm -rf "$tmp"
"$python" - "$wheel" "$tmp" <<'PY'
import sys, zipfile, os
wheel, out = sys.argv[1], sys.argv[2]
keep = {
    "flashinfer/data/include/flashinfer/": "include/flashinfer/",
    "flashinfer/data/cutlass/include/": "cutlass/include/",
    "flashinfer/data/cccl/libcudacxx/include/": "cccl/libcudacxx/include/",
    "flashinfer/data/cccl/cub/cub/": "cccl/cub/cub/",
    "flashinfer/data/cccl/thrust/thrust/": "cccl/thrust/thrust/",
}
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        target = None
        for src, dst in keep.items():
            if name.startswith(src) and not name.endswith("/"):
                target = dst + name[len(src):]
        if name.endswith("dist-info/licenses/LICENSE"):
            target = "LICENSE"
        if target is None:
            continue
        path = os.path.join(out, target)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(name) as f, open(path, "wb") as g:
            g.write(f.read())
PY
echo "$version" >"$tmp/VERSION"
rm -rf "$dest"
mv "$tmp" "$dest"
rm -f "$wheel"
echo "flashinfer $version headers in $dest" >&2
