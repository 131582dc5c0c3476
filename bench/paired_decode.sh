#!/usr/bin/env bash
# Decode tok/s of two builds side by side: `generate --prompt <about L tokens> --n N --threads 2
# [--kv FMT]` of binary A, then of binary B, ROUNDS times, interleaved so that a slow spell of the
# machine falls on both; prints each binary's runs, sorted (the median is the middle).
# Usage: bench/paired_decode.sh A B L ROUNDS N [FMT]   (FMT empty: the plain engine)
set -euo pipefail
a=$1 b=$2 L=$3 rounds=$4 n=$5 fmt=${6:-}
source "$(dirname "$0")/prompt_text.sh"
text=$(prompt_text "$L")
args=()
[[ -n $fmt ]] && args=(--kv "$fmt")
declare -A runs
for ((r = 0; r < rounds; ++r)); do
  for which in A B; do
    bin=$a
    [[ $which == B ]] && bin=$b
    err=$("$bin" generate --prompt "$text" --n "$n" --threads 2 "${args[@]}" 2>&1 >/dev/null | grep 'decode:')
    runs[$which]+=" $(sed -E 's/.*decode: [0-9]+ tokens, ([0-9.]+) tok\/s.*/\1/' <<<"$err")"
  done
done
for which in A B; do echo "$which:$(tr ' ' '\n' <<<"${runs[$which]}" | sort -g | tr '\n' ' ')"; done
