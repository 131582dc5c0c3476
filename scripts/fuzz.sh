#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (docs/fuzzing.md) and runs each for a bounded time from
# its seeds: the GGUF reader and the server's request parsing. Usage: scripts/fuzz.sh [SECONDS]
# (per target; default 60). Exits non-zero on the first crash, leak or sanitizer report, whose
# input libFuzzer leaves under fuzz-corpus/<target>-crashes/.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
[ -n "${WITCERT_SETUP_DONE:-}" ] || scripts/install-deps.sh
build_dir=build-fuzz
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DWITCERT_FUZZ=ON >/dev/null
cmake --build "$build_dir" --target gguf_fuzz gguf_fuzz_seeds request_fuzz
mkdir -p fuzz-corpus/gguf fuzz-corpus/gguf-crashes fuzz-corpus/request fuzz-corpus/request-crashes
"$build_dir"/gguf_fuzz_seeds fuzz-corpus/gguf
cp fuzz/request-seeds/*.json fuzz-corpus/request/
run() {  # target dict
  local log=fuzz-corpus/$1.log rc=0
  "$build_dir/$1_fuzz" -max_total_time="$seconds" -print_final_stats=1 -timeout=30 -dict="fuzz/$2" \
    -artifact_prefix="fuzz-corpus/$1-crashes/" "fuzz-corpus/$1" >"$log" 2>&1 || rc=$?
  grep -a -v -e '^#[0-9]' -e 'Uses:' -e 'recommended dictionary' "$log" | tail -12
  if [ "$rc" -ne 0 ]; then
    echo "fuzz: $1 failed (exit $rc); its input is under fuzz-corpus/$1-crashes/" >&2
    return 1
  fi
}
run gguf gguf.dict
run request request.dict
