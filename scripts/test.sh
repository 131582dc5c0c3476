#!/usr/bin/env bash
# Builds and runs the whole test suite: C++ (ctest, every label), Python (pytest; the vLLM plugin in
# .venv-vllm) and the Coq proofs.
# Usage: scripts/test.sh [BUILD_DIR] [extra cmake args...]
# With WITCERT_SETUP_DONE=1 (.ci/run, which does it once) it skips installing and fetching.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${WITCERT_SETUP_DONE:-}" ]; then
  scripts/install-deps.sh
  scripts/fetch-model.sh  # the real-model tests fail without it
  scripts/fetch-eval-data.sh  # the corpus of `witcert eval --quick`
fi
build_dir=${1:-build}
shift || true
scripts/build.sh "$build_dir" "$@"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"
# The Python package (pip install ., pytest) against this build; not in the sanitizer build, whose
# library needs the sanitizer runtime loaded before Python.
case " $* " in
  *" -DWITCERT_SANITIZE=ON "*) ;;
  *) scripts/python-test.sh "$build_dir"
     scripts/vllm-test.sh ;;  # the vLLM plugin, in its own venv (slow: vLLM engines)
esac
make -C proofs
