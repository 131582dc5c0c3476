#!/usr/bin/env bash
# `witcert serve` against llama-server at equal KV memory: each server started in turn on the
# test model with 2 threads, loaded by bench/serve_load.py at concurrency 1–32 (2 streamed
# completions per client, ~200-word prompts, 64 new tokens), then stopped. witcert runs fp16,
# dither-int8 and q8_0 gated at τ_K 0.2 with --kv-memory MEM; llama-server runs its f16 and q8_0
# caches with the context (-c, shared by 32 slots) whose cache takes MEM. Builds nothing.
# Usage: bench/serve_compare.sh [WITCERT] [LLAMA_SERVER] [MEM_MIB]
#   (default: build/witcert build-peer/llama-server 512)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
witcert=${1:-$root/build/witcert}
llama=${2:-$root/build-peer/llama-server}
mem_mib=${3:-512}
model=$root/models/SmolLM2-135M-Instruct.Q4_1.gguf
port=18080
load=(python3 "$root/bench/serve_load.py" "http://127.0.0.1:$port" --concurrency 1,2,4,8,16,32 --requests 2
      --max-tokens 64 --prompt-words 200)

wait_ready() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "server on $port never became ready" >&2
  return 1
}

run() {  # label, then the server's command line
  local label=$1
  shift
  "$@" >/dev/null 2>&1 &
  local pid=$!
  wait_ready
  "${load[@]}" --label "$label" | tail -n +3
  kill -TERM "$pid"
  wait "$pid" || true
}

echo "| server | C | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | requests | errors |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for kv in fp16 dither-int8; do
  run "witcert $kv" "$witcert" serve --model "$model" --port $port --threads 2 --max-seqs 32 --kv "$kv" \
    --kv-memory "${mem_mib}M" --max-tokens 64
done
run "witcert q8_0 gated 0.2" "$witcert" serve --model "$model" --port $port --threads 2 --max-seqs 32 --kv q8_0 \
  --gate 0.2 --kv-memory "${mem_mib}M" --max-tokens 64
# llama.cpp's cache per token: 30 layers × 3 KV heads × 64 × (K + V): 23,040 B in f16, 12,240 B in q8_0.
for ct in f16:23040 q8_0:12240; do
  type=${ct%%:*}
  ctx=$((mem_mib * 1048576 / ${ct##*:}))
  run "llama-server $type" "$llama" -m "$model" --port $port -t 2 -c "$ctx" -np 32 -fa on -ctk "$type" -ctv "$type"
done
echo
echo "bench/serve_compare.sh: ${mem_mib} MiB of KV cache each, bench/serve_load.py --requests 2 --max-tokens 64 --prompt-words 200"
