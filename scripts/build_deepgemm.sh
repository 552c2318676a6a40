#!/usr/bin/env bash
# Builds DeepGEMM (the anchor of benchmarks/deepgemm.py) in place from a source tree that holds
# its third-party/cutlass/include and third-party/fmt/include, on a machine with nvcc and
# PyTorch with CUDA; afterwards put the tree on PYTHONPATH.
#   scripts/build_deepgemm.sh path/to/DeepGEMM
# The extension must be built by the C++ compiler whose libstdc++ the process loads (the
# system g++ by default, DEEPGEMM_CXX to change it): built by another toolchain it crashed
# inside libstdc++ (std::regex, ostream) at its first GEMM.
set -euo pipefail
src=$(realpath "$1")
cd "$src"
ln -sfn "$src/third-party/cutlass/include/cutlass" deep_gemm/include/cutlass
ln -sfn "$src/third-party/cutlass/include/cute" deep_gemm/include/cute
export CXX=${DEEPGEMM_CXX:-/usr/bin/g++}
export CC=${DEEPGEMM_CC:-/usr/bin/gcc}
DG_USE_LOCAL_VERSION=0 python3 setup.py build_ext --inplace
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)"
