#!/usr/bin/env bash
# Decode speed of every KV-cache format on the real model: `witcert generate --n 64 --threads 2
# --kv FMT` after a prompt of about L tokens, L = 128, 1024 and 4096, RUNS runs each (default 3),
# printed as a markdown table of the median decode tok/s (generate reports prefill and decode
# tok/s on stderr). Builds nothing. Usage: bench/decode_formats.sh [BINARY] [FORMATS...]
# (default: build/witcert; fp16, the dithered formats and every Tier-A scheme of `witcert schemes`).
set -euo pipefail
bin=${1:-build/witcert}
shift || true
runs=${RUNS:-3}
lengths=${LENGTHS:-"128 1024 4096"}
if [[ $# -gt 0 ]]; then
  formats=("$@")
else
  mapfile -t formats < <("$bin" schemes | awk '$NF == "A" && NF > 3 { print $1 }' | sort -u)
  formats=(dither-int8 dither-int6 dither-int5 dither-int4 "${formats[@]}")
fi
# A prompt of about L tokens (bench/prompt_text.sh); the table prints its measured token count.
source "$(dirname "$0")/prompt_text.sh"
median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }'; }
header="| format |"
rule="| --- |"
declare -A tokens
for L in $lengths; do
  header+=" L ≈ $L |"
  rule+=" ---: |"
done
echo "$header"
echo "$rule"
for fmt in "${formats[@]}"; do
  row="| $fmt |"
  for L in $lengths; do
    prompt=$(prompt_text "$L")
    speeds=()
    for ((r = 0; r < runs; ++r)); do
      err=$("$bin" generate --prompt "$prompt" --n 64 --threads 2 --kv "$fmt" 2>&1 >/dev/null | grep 'decode:')
      tokens[$L]=$(sed -E 's/^prefill: ([0-9]+) tokens.*/\1/' <<<"$err")
      speeds+=("$(sed -E 's/.*decode: [0-9]+ tokens, ([0-9.]+) tok\/s.*/\1/' <<<"$err")")
    done
    row+=" $(printf '%s\n' "${speeds[@]}" | median) |"
  done
  echo "$row"
done
echo
for L in $lengths; do echo "L ≈ $L: ${tokens[$L]} prompt tokens"; done
echo "decode tok/s, median of $runs runs of: $bin generate --prompt <L tokens> --n 64 --threads 2 --kv FMT"
