#!/usr/bin/env bash
# Installs the dependencies, builds, and runs every test (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh "$@"
# The Node.js interoperability client's packages, exactly as locked.
(cd tests/interop/node && npm ci --no-audit --no-fund --loglevel=error)
ctest --test-dir build --output-on-failure -j "$(nproc)"
