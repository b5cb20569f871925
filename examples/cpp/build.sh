#!/bin/sh
# One-command build without cmake: g++ against the libtorch inside the pip torch wheel
# (docs/howto/cpp-libtorch.md). Usage: examples/cpp/build.sh [output binary] ; PYTHON=... to pick the python.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-"$here/build/fedmvp_infer"}
py=${PYTHON:-python3}
torch_dir=${TORCH_DIR:-$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')}
abi=$("$py" -c 'import torch; print(int(torch.compiled_with_cxx11_abi()))')
mkdir -p "$(dirname "$out")"
exec ${CXX:-g++} -std=c++20 -O2 -ffp-contract=off -D_GLIBCXX_USE_CXX11_ABI="$abi" \
  -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include" \
  "$here/src/fedmvp_infer.cpp" -o "$out" \
  -L"$torch_dir/lib" -Wl,-rpath,"$torch_dir/lib" -ltorch_cpu -lc10 -ljpeg -lpng -lpthread
