#!/usr/bin/env bash
# Configures and builds WitCert. Usage: scripts/build.sh [BUILD_DIR] [extra cmake args...]
# Warnings are errors in every build it makes, so that setup.sh, test.sh and CI configure build/
# alike and one does not rebuild what another built. With ccache installed (install-deps.sh) it
# compiles through it, so that the Python package's build reuses these objects (python-test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
shift || true
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWITCERT_WERROR=ON "${launcher[@]}" "$@" >/dev/null
cmake --build "$build_dir" -j "$(nproc)"
