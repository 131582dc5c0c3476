#!/usr/bin/env bash
# WitCert beside llama.cpp on one GGUF (default: Gemma 3 270M Q4_K_M), 2 threads, at prompts of
# about L = 128, 1,024 and 4,096 tokens: prefill tok/s, decode tok/s after the prompt and peak RSS,
# for fp16 KV against llama.cpp's f16 cache and dither-int8 against its q8_0 cache (flash
# attention on, as q8_0 needs). Each round runs every cell of both engines once, so that a slow
# spell of the machine falls on both; the table prints medians over ROUNDS (default 3).
#   ours:   /usr/bin/time witcert generate --prompt <L tokens> --n N --threads 2 [--kv dither-int8]
#   theirs: llama-bench -p T -n 0 (prefill of the same T tokens), -p 0 -n N -d T (decode after
#           them), and /usr/bin/time llama-bench -p T -n N -r 1 for the peak RSS
# llama.cpp comes from bench/llama_cpp_peer.sh (built there if missing). Usage:
#   bench/gemma_peer.sh [MODEL]   (ROUNDS, N, LENGTHS, BIN override the defaults)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
model=${1:-$root/models/gemma-3-270m-q4_k_m.gguf}
bin=${BIN:-$root/build/witcert}
rounds=${ROUNDS:-3} n=${N:-32} lengths=${LENGTHS:-"128 1024 4096"}
peer=$root/build-peer
[[ -x $peer/llama-bench ]] || BUILD_ONLY=1 "$root/bench/llama_cpp_peer.sh"
source "$root/bench/prompt_text.sh"
median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }'; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
declare -A tokens samples
# llama-bench's mean tok/s of its one test, from its jsonl line.
bench_ts() { "$peer/llama-bench" -m "$model" -t 2 -r 1 -o jsonl "$@" 2>/dev/null | python3 -c \
  'import json, sys; print(json.loads(sys.stdin.readline())["avg_ts"])'; }
for ((r = 0; r < rounds; ++r)); do
  for L in $lengths; do
    prompt=$(prompt_text "$L")
    for kv in fp16 dither-int8; do
      args=()
      [[ $kv == dither-int8 ]] && args=(--kv dither-int8)
      /usr/bin/time -f '%M' -o "$tmp/rss" "$bin" generate --model "$model" --prompt "$prompt" --n "$n" --threads 2 \
        "${args[@]}" 2>"$tmp/err" >/dev/null
      line=$(grep 'decode:' "$tmp/err")
      T=$(sed -E 's/^prefill: ([0-9]+) tokens.*/\1/' <<<"$line")
      tokens[$L]=$T
      samples[$L,$kv,ours,prefill]+=" $(sed -E 's/^prefill: [0-9]+ tokens, ([0-9.]+) tok\/s.*/\1/' <<<"$line")"
      samples[$L,$kv,ours,decode]+=" $(sed -E 's/.*decode: [0-9]+ tokens, ([0-9.]+) tok\/s.*/\1/' <<<"$line")"
      samples[$L,$kv,ours,rss]+=" $(($(cat "$tmp/rss") / 1024))"
      cache=(-fa 1)
      [[ $kv == dither-int8 ]] && cache=(-fa 1 -ctk q8_0 -ctv q8_0)
      samples[$L,$kv,peer,prefill]+=" $(bench_ts "${cache[@]}" -p "$T" -n 0)"
      samples[$L,$kv,peer,decode]+=" $(bench_ts "${cache[@]}" -p 0 -n "$n" -d "$T")"
      /usr/bin/time -f '%M' -o "$tmp/rss" "$peer/llama-bench" -m "$model" -t 2 -r 1 "${cache[@]}" -p "$T" -n "$n" \
        >/dev/null 2>&1
      samples[$L,$kv,peer,rss]+=" $(($(cat "$tmp/rss") / 1024))"
    done
  done
done
med() { tr ' ' '\n' <<<"${samples[$1]}" | grep . | median; }
echo "| prompt | KV (ours / llama.cpp) | prefill tok/s | | ratio | decode tok/s | | ratio | peak RSS MiB | | difference |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for L in $lengths; do
  for kv in fp16 dither-int8; do
    peer_kv=f16
    [[ $kv == dither-int8 ]] && peer_kv=q8_0
    row="| ${tokens[$L]} | $kv / $peer_kv |"
    for what in prefill decode; do
      a=$(med "$L,$kv,ours,$what") b=$(med "$L,$kv,peer,$what")
      row+=" $a | $(printf '%.1f' "$b") | $(python3 -c "print(f'{$a / $b:.2f}×')") |"
    done
    a=$(med "$L,$kv,ours,rss") b=$(med "$L,$kv,peer,rss")
    row+=" $a | $b | $((a - b)) |"
    echo "$row"
  done
done
echo
echo "medians of $rounds rounds; ours: $bin generate --n $n --threads 2; llama.cpp: llama-bench -t 2 -fa 1 (build-peer)"
