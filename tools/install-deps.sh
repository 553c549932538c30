#!/usr/bin/env bash
# Installs the Debian packages listed in deploy/debian-packages.txt (needs root or sudo), and npm
# when no npm is on the PATH (a Node.js from elsewhere usually brings its own).
#   tools/install-deps.sh [--no-tests]   (--no-tests: only what builds and runs the server)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--no-tests" ]; then
  packages=$(sed '/^\[tests\]/,$d' deploy/debian-packages.txt | grep -v '^\s*#' | grep -v '^\s*$')
else
  packages=$(grep -v '^\s*#' deploy/debian-packages.txt | grep -v '^\s*$' | grep -v '^\[')
fi
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ "${1:-}" = "--no-tests" ] || command -v npm >/dev/null || missing="$missing npm"
if [ -n "$missing" ]; then
  echo "install-deps: installing$missing"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends $missing
fi
