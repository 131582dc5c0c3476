#!/usr/bin/env bash
# Aggregate decode speed of `witcert batch` against concurrency B: B requests of about 512 prompt
# tokens and 128 new tokens each (--ignore-eos), --max-seqs B, 2 threads, per format. Prints a
# markdown table of the decode-only tok/s (the steps that run only decode tokens: B·128 tokens
# over their time, as llama-batched-bench's S_TG) and the whole run's generated tok/s (prefill
# included). Builds nothing. Usage: bench/batch_throughput.sh [BINARY] [FORMATS...]
# (default: build/witcert; plain fp16 dither-int8 q8_0, "plain" being the exact cache without a
# meter). BATCHES="1 2 4" to choose the concurrencies.
set -euo pipefail
bin=${1:-build/witcert}
shift || true
if [[ $# -gt 0 ]]; then formats=("$@"); else formats=(plain fp16 dither-int8 q8_0); fi
batches=${BATCHES:-"1 2 4 8 16 32"}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
source "$(dirname "$0")/prompt_text.sh"
text=$(prompt_text 512)
header="| format |"
rule="| --- |"
for B in $batches; do header+=" B = $B |"; rule+=" ---: |"; done
echo "decode-only tok/s; whole run tok/s"
echo
echo "$header"
echo "$rule"
for fmt in "${formats[@]}"; do
  row="| $fmt |"
  for B in $batches; do
    : >"$dir/in.jsonl"
    for ((i = 0; i < B; ++i)); do
      printf '{"prompt": "Request %d. %s", "max_tokens": 128}\n' "$i" "$text" >>"$dir/in.jsonl"
    done
    args=(batch --input "$dir/in.jsonl" --output "$dir/out.jsonl" --max-seqs "$B" --threads 2 --ignore-eos)
    [[ $fmt != plain ]] && args+=(--kv "$fmt")
    err=$("$bin" "${args[@]}" 2>&1 >/dev/null)
    decode=$(sed -nE 's/.*decode-only steps: [0-9]+ tokens in [0-9.]+ s \(([0-9.]+) tok\/s\).*/\1/p' <<<"$err")
    whole=$(sed -nE 's/^batch: .* \(([0-9.]+) tok\/s\).*/\1/p' <<<"$err")
    row+=" $decode; $whole |"
  done
  echo "$row"
done
echo
echo "$bin batch --max-seqs B --threads 2 --ignore-eos [--kv FMT]: B requests of ~512 prompt tokens, 128 new tokens each"
