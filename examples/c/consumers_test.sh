#!/usr/bin/env bash
# Installs the build into a fresh prefix, then builds examples/c/meter.c against it twice, as a
# project outside the tree would: with CMake's find_package(witcert) and with pkg-config. Both
# must run and print a meter. Usage: consumers_test.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -euo pipefail
src=$1 build=$2 work=$3
rm -rf "$work"
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
cmake -S "$src/examples/c" -B "$work/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/cmake-build" >/dev/null
libdir=$(dirname "$(find "$prefix" -name 'libwitcert.so.1' | head -1)")
out_cmake=$(LD_LIBRARY_PATH=$libdir "$work/cmake-build/meter")
pc=$(dirname "$(find "$prefix" -name witcert.pc | head -1)")
# shellcheck disable=SC2046
cc -std=c99 -Wall -Wextra -Werror "$src/examples/c/meter.c" -o "$work/meter-pc" \
  $(PKG_CONFIG_PATH=$pc pkg-config --cflags --libs witcert) -lm
out_pc=$(LD_LIBRARY_PATH=$libdir "$work/meter-pc")
echo "$out_cmake"
for out in "$out_cmake" "$out_pc"; do
  grep -q '^step 47: meter [0-9]' <<<"$out" || { echo "no meter in: $out" >&2; exit 1; }
  grep -q 'n = 0: invalid argument' <<<"$out" || { echo "no refusal in: $out" >&2; exit 1; }
done
[ "$out_cmake" = "$out_pc" ] || { echo "the two builds disagree" >&2; exit 1; }
echo "consumers: find_package and pkg-config builds agree"
