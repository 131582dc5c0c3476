#!/usr/bin/env bash
# Aggregate tokens/s at equal KV memory, where the pool is the binding limit: N requests of about
# L prompt tokens and 128 new tokens each (--ignore-eos), one --kv-memory for every format, as
# many sequences at once as fit (--max-seqs N). Prints each format's decode-only and whole-run
# tok/s and the most sequences that ran at once. Builds nothing.
# Usage: bench/batch_equal_memory.sh [BINARY] [KV_MEMORY] [N] [L] [FORMATS...]
# (default: build/witcert 760M 16 3968 fp16 dither-int8: 760M holds 8 fp16 sequences of 4,096 tokens)
set -euo pipefail
bin=${1:-build/witcert}
memory=${2:-760M}
n=${3:-16}
len=${4:-3968}
shift 4 || shift $#
if [[ $# -gt 0 ]]; then formats=("$@"); else formats=(fp16 dither-int8); fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
source "$(dirname "$0")/prompt_text.sh"
text=$(prompt_text "$len")
for ((i = 0; i < n; ++i)); do
  printf '{"prompt": "Request %d. %s", "max_tokens": 128}\n' "$i" "$text" >>"$dir/in.jsonl"
done
echo "| format | decode-only tok/s | whole run tok/s | sequences at once | preemptions |"
echo "| --- | ---: | ---: | ---: | ---: |"
for fmt in "${formats[@]}"; do
  args=(batch --input "$dir/in.jsonl" --output "$dir/out.jsonl" --max-seqs "$n" --threads 2 --ignore-eos --kv-memory "$memory")
  [[ $fmt != plain ]] && args+=(--kv "$fmt")
  err=$("$bin" "${args[@]}" 2>&1 >/dev/null)
  decode=$(sed -nE 's/.*decode-only steps: [0-9]+ tokens in [0-9.]+ s \(([0-9.]+) tok\/s\).*/\1/p' <<<"$err")
  whole=$(sed -nE 's/^batch: .* \(([0-9.]+) tok\/s\).*/\1/p' <<<"$err")
  seqs=$(sed -nE 's/.*up to ([0-9]+) sequences at once.*/\1/p' <<<"$err")
  pre=$(sed -nE 's/.*, ([0-9]+) preemptions.*/\1/p' <<<"$err")
  echo "| $fmt | ${decode:-–} | $whole | $seqs | $pre |"
done
echo
echo "$bin batch --kv-memory $memory --max-seqs $n --threads 2 --ignore-eos [--kv FMT]: $n requests of ~$len prompt tokens, 128 new tokens each"
