#!/usr/bin/env bash
# Builds the Python package from the checkout into .venv (`pip install .`), then runs its tests
# against BUILD_DIR's `witcert` binary and libwitcert.so. Usage: scripts/python-test.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
scripts/install-deps.sh
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) .venv/bin/pip install -q .
WITCERT_BIN=$build_dir/witcert WITCERT_LIB=$build_dir/libwitcert.so \
  WITCERT_MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf .venv/bin/python -m pytest -q python/tests
