#!/usr/bin/env bash
# Installs the dependencies, builds, and runs the main job: for now a generation with ttt-generate
# on a small bundled test model (random weights: the ids it prints are noise, but exact noise).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
model=tests/data/golden/small-linear-m64
echo "ttt-generate --model $model --prompt-ids 1,72,101,108,108,111 --max-new-tokens 32"
build/server/ttt-generate --model "$model" --prompt-ids 1,72,101,108,108,111 --max-new-tokens 32 \
  --ignore-eos
