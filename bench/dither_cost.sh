#!/usr/bin/env bash
# The per-slot vs shared-page measurements of docs/dither-cost.md: one invocation of the driver
# per prompt (several minutes each on 2 shared cores), then the table.
# Usage: bench/dither_cost.sh [OUT_DIR]   (after scripts/build.sh; the model under models/)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/dither_cost}
mkdir -p "$out"
for i in 0 1 2 3; do
  replay=()
  if [ "$i" = 0 ]; then replay=(--replay-check); fi
  nice build/witcert_dither_cost --prompts bench/dither_cost_prompts.jsonl --select "$i" --seeds 4 --n 32 \
    "${replay[@]}" > "$out/prompt$i.jsonl"
done
python3 bench/dither_cost_table.py "$out"/prompt*.jsonl
