#!/usr/bin/env bash
# Installs TVM and tvmamp on a bare, offline GPU machine from files carried in .dev/:
#   .dev/libtvm_compiler.so.xz  TVM's compiler library (xz, x86 filter), too big for a wheel
#   .dev/tvm_py.tar.xz          the rest of the apache-tvm wheel (py3-none)
#   .dev/tvm_ffi.tar.xz         the apache-tvm-ffi wheel for that machine's Python
# bench/device/pack.sh makes them. Prints the PYTHONPATH to export.
set -euo pipefail
site=${1:-/tmp/site}
mkdir -p "$site"
tar -xJf .dev/tvm_py.tar.xz -C "$site"
tar -xJf .dev/tvm_ffi.tar.xz -C "$site"
python3 - "$site" <<'PY'
import lzma, shutil, sys
with lzma.open(".dev/libtvm_compiler.so.xz") as src, open(f"{sys.argv[1]}/tvm/lib/libtvm_compiler.so", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 24)
PY
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site/tvmamp_site" . >&2
echo "$site/tvmamp_site:$site"
