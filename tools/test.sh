#!/usr/bin/env bash
# Installs the dependencies, builds, and runs every test (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh "$@"
ctest --test-dir build --output-on-failure -j "$(nproc)"
