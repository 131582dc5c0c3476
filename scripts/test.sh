#!/usr/bin/env bash
# Builds and runs the whole test suite: C++ (ctest), Python (pytest) and the Coq proofs.
# Usage: scripts/test.sh [BUILD_DIR] [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/fetch-model.sh  # the real-model tests fail without it
scripts/fetch-eval-data.sh  # the corpus of `witcert eval --quick`
tools/check_layers.py  # no file includes a layer above its own
build_dir=${1:-build}
shift || true
scripts/build.sh "$build_dir" -DWITCERT_WERROR=ON "$@"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"
# The Python package (pip install ., pytest) against this build; not in the sanitizer build, whose
# library needs the sanitizer runtime loaded before Python.
case " $* " in
  *" -DWITCERT_SANITIZE=ON "*) ;;
  *) scripts/python-test.sh "$build_dir" ;;
esac
make -C proofs
