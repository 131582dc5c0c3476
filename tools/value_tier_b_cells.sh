#!/bin/bash
# The value side's Tier B against its sure bound, cell by cell, on SmolLM2 with per-slot dither
# (docs/tier-b.md, "Values"): for each width and outlier budget, one prose prompt and 24 new
# tokens with every cell checked, then per width the V coverage at τ_V 0.05 of both bounds, how
# often and by how much Tier B is the smaller, the true error against the served V meter, and
# the violations (K or V). Usage: tools/value_tier_b_cells.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/value-tier-b}
mkdir -p "$out"
prompt=$(head -c 2200 data/eval/prose/GPL-3.txt | tail -c 1800)
for bits in 4 5 6 8; do
  for m in 0 4; do
    build/witcert generate --kv "dither-int$bits" --outliers "$m" --dither per-slot --n 24 --threads 1 \
      --prompt "$prompt" --check-soundness --meter-json "$out/cells-$bits-$m.jsonl" --json >"$out/out-$bits-$m.json" 2>/dev/null
    .venv/bin/python - "$out/cells-$bits-$m.jsonl" "dither-int$bits m=$m" <<'PY'
import json, sys
cells = [json.loads(line) for line in open(sys.argv[1])]
n, tau = len(cells), 0.05
served = sum(c["v_meter"] <= tau for c in cells)
sure = sum(c.get("v_meter_sure", c["v_meter"]) <= tau for c in cells)
smaller = sorted(c["v_meter"] / c["v_meter_sure"] for c in cells if c.get("v_meter_sure", 0) > 0)
ratio = sorted(c["v_true"] / c["v_meter"] for c in cells if c.get("v_true", 0) > 0 and c["v_meter"] > 0)
bad = sum(c.get("v_true", 0) > c["v_meter"] * (1 + 1e-9) + 1e-12 or c.get("tv", 0) > c["meter"] * (1 + 1e-9) + 1e-12
          for c in cells)
med = lambda v: v[len(v) // 2] if v else float("nan")
print(f"{sys.argv[2]}: {n} cells; V coverage at 0.05: sure {sure / n:.4f}, Tier B {served / n:.4f}; "
      f"Tier B smaller in {len(smaller) / n:.1%}, median ratio {med(smaller):.3f} (min {smaller[0] if smaller else 0:.3f}); "
      f"true/served median {med(ratio):.3f} (max {ratio[-1] if ratio else 0:.3f}); violations {bad}")
PY
  done
done
