#!/usr/bin/env bash
# Regenerates fill.ptx and copy.ptx from the .cu sources. Needs nvcc (run it on a machine with the
# CUDA toolkit). Each PTX file starts with comment lines recording the nvcc version, the flags and
# the SHA-256 of its source; kernels_test.go fails when a .cu no longer matches its PTX.
set -euo pipefail
cd "$(dirname "$0")"
flags="-ptx -arch=compute_75 -O3"
ver=$(nvcc --version | grep -o 'release [0-9.]*, V[0-9.]*' | head -1)
out=${1:-.}
for k in fill copy; do
  sum=$(sha256sum "$k.cu" | cut -d' ' -f1)
  nvcc $flags "$k.cu" -o "/tmp/$k.ptx"
  {
    echo "// Generated from $k.cu by internal/kernels/gen.sh. Do not edit."
    echo "// nvcc: $ver"
    echo "// flags: $flags"
    echo "// source-sha256: $sum"
    cat "/tmp/$k.ptx"
  } > "$out/$k.ptx"
done
