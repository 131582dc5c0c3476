#!/usr/bin/env bash
# The per-slot vs shared-page measurements of docs/dither-cost.md: one invocation of the driver
# per prompt (several minutes each on 2 shared cores), then the table.
# Usage: bench/dither_cost.sh [OUT_DIR]   (after scripts/build.sh; the model under models/)
# SEEDS, N and FIRST_SEED (defaults 4, 32, 0) set the seeds per prompt and mode, the decode steps
# and the first seed index, so that two runs can cover disjoint seed ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/dither_cost}
seeds=${SEEDS:-4}
n=${N:-32}
first=${FIRST_SEED:-0}
mkdir -p "$out"
for i in 0 1 2 3; do
  replay=()
  if [ "$i" = 0 ]; then replay=(--replay-check); fi
  nice build/witcert_dither_cost --prompts bench/dither_cost_prompts.jsonl --select "$i" --seeds "$seeds" --n "$n" --first-seed "$first" \
    "${replay[@]}" > "$out/prompt$i-seed$first.jsonl"
done
python3 bench/dither_cost_table.py "$out"/prompt*.jsonl
