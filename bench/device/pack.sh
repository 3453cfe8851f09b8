#!/usr/bin/env bash
# Makes .dev/ for bench/device/setup.sh: TVM and tvm-ffi wheels for the GPU machine's Python
# (default 3.12), repacked to fit the device tool's 64 MiB limit on what travels. The TVM
# wheel is 100 MB; its compiler library alone, xz-compressed with the x86 filter, is ~55 MB.
# Run from the repository root; .dev/ is ignored by git. Takes about 5 minutes (xz -9e).
set -euo pipefail
py=${1:-3.12}
tag=cp${py/./}
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
  --implementation cp --platform manylinux_2_28_x86_64 -d "$work" \
  apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post1
mkdir -p .dev "$work/tvm" "$work/ffi"
(cd "$work/tvm" && unzip -q "$work"/apache_tvm-*.whl -x 'tvm/3rdparty/*' 'tvm/web/*' \
  && xz --x86 --lzma2=preset=9e,dict=256MiB -T1 -c tvm/lib/libtvm_compiler.so \
  > "$OLDPWD/.dev/libtvm_compiler.so.xz" && rm tvm/lib/libtvm_compiler.so \
  && tar -cf - . | xz -9e -T0 > "$OLDPWD/.dev/tvm_py.tar.xz")
(cd "$work/ffi" && unzip -q "$work"/apache_tvm_ffi-*-"$tag"-*.whl \
  -x 'tvm_ffi/3rdparty/*' \
  && tar -cf - . | xz -9e -T0 > "$OLDPWD/.dev/tvm_ffi.tar.xz")
rm -rf "$work"
ls -l .dev
