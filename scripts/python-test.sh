#!/usr/bin/env bash
# Builds the Python package from the checkout into .venv (`pip install .`), then runs its tests
# against BUILD_DIR's `witcert` binary and libwitcert.so. Usage: scripts/python-test.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
[ -n "${WITCERT_SETUP_DONE:-}" ] || scripts/install-deps.sh
scripts/install-transformers.sh  # idempotent: the transformers tests run here, never skipped
# The package's library is compiled with BUILD_DIR's compiler, launcher and warnings: through ccache
# (scripts/build.sh) that gives it BUILD_DIR's objects instead of compiling them again.
defines=()
for var in CMAKE_CXX_COMPILER CMAKE_CXX_COMPILER_LAUNCHER WITCERT_WERROR; do
  value=$(sed -n "s/^$var:[A-Z]*=//p" "$build_dir/CMakeCache.txt" 2>/dev/null || true)
  if [ -n "$value" ]; then defines+=(-C "cmake.define.$var=$value"); fi
done
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) .venv/bin/pip install -q "${defines[@]}" .
WITCERT_BIN=$build_dir/witcert WITCERT_LIB=$build_dir/libwitcert.so WITCERT_REQUIRE_TRANSFORMERS=1 \
  WITCERT_MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf .venv/bin/python -m pytest -q python/tests \
  --ignore=python/tests/vllm  # .venv has no vLLM: scripts/vllm-test.sh runs those in .venv-vllm
