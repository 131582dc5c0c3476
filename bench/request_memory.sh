#!/usr/bin/env bash
# What one request holds beyond its keys and values as its answer grows: `witcert batch` runs a
# single request of N generated tokens (greedy, a counting prompt that does not stop early) over a
# KV cache of format FMT; its peak RSS (/usr/bin/time; the pool's pages are taken as first
# written) minus its KV bytes (its tokens times the KV bytes per token `generate` reports for FMT)
# is the process's memory beyond the KV cache. Prints N, the request's tokens, peak RSS, KV bytes
# and their difference in MB. Usage: bench/request_memory.sh [BINARY] [FMT] [N...] (default
# build/witcert, q8_0, 256 and 4096).
set -euo pipefail
bin=${1:-build/witcert}
fmt=${2:-q8_0}
shift 2 || shift $#
lengths=("$@")
[[ ${#lengths[@]} -gt 0 ]] || lengths=(256 4096)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
prompt=$(seq 1 40 | paste -sd, | sed 's/,/, /g')
per_token=$("$bin" generate --prompt "1, 2, 3" --n 1 --kv "$fmt" --threads 2 2>&1 >/dev/null |
  sed -nE 's/.*KV bytes per token: ([0-9]+).*/\1/p')
echo "| max_tokens | prompt + completion tokens | peak RSS MB | KV MB ($per_token B/token) | beyond KV MB |"
echo "| ---: | ---: | ---: | ---: | ---: |"
for n in "${lengths[@]}"; do
  printf '{"prompt": "%s,", "max_tokens": %d}\n' "$prompt" "$n" >"$dir/in.jsonl"
  /usr/bin/time -f '%M' -o "$dir/rss" "$bin" batch --input "$dir/in.jsonl" --output "$dir/out.jsonl" --kv "$fmt" \
    --threads 2 --kv-memory 1G 2>"$dir/err" >/dev/null
  rss_kb=$(tail -1 "$dir/rss")
  tokens=$(python3 -c 'import json,sys; r = json.loads(open(sys.argv[1]).readline()); print(r["prompt_tokens"] + r["completion_tokens"])' "$dir/out.jsonl")
  awk -v n="$n" -v t="$tokens" -v rss="$rss_kb" -v kv="$((tokens * per_token))" \
    'BEGIN { printf "| %d | %d | %.1f | %.1f | %.1f |\n", n, t, rss / 1024, kv / 1048576, rss / 1024 - kv / 1048576 }'
done
