#!/usr/bin/env bash
# Installs the dependencies and builds ttt-serve into build/ (Release).
# CUDA code is built when nvcc is found (PATH or /usr/local/cuda); pass -DTTT_WITH_CUDA=OFF to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build
