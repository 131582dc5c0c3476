#!/usr/bin/env bash
# `witcert eval all --quick` from nothing: exit 0 (no soundness violation), every table, CSV and
# plot written; a second run finds every cell done and recomputes none; a missing corpus and an
# unknown experiment are refused with the fix. Usage: eval_quick_test.sh WITCERT SOURCE_DIR WORK_DIR
set -euo pipefail
bin=$1 src=$2 work=$3
rm -rf "$work"
cd "$src"
"$bin" eval all --quick --out "$work" > "$work.log" 2>&1 || { cat "$work.log"; exit 1; }
for f in soundness/soundness.md soundness/soundness.csv soundness/soundness.png soundness/soundness.svg \
         schemes/schemes.md schemes/schemes.csv schemes/cells.csv schemes/scatter.png schemes/scatter.svg \
         schemes/roc.png schemes/roc.svg schemes/tightness.png schemes/tightness.svg \
         shapes/shapes.md shapes/shapes.csv shapes/shapes.png shapes/shapes.svg \
         outliers/outliers.md outliers/outliers.csv outliers/outliers.png outliers/outliers.svg \
         outliers/control.md outliers/control.csv \
         risk-coverage/risk-coverage.md risk-coverage/curve.csv risk-coverage/risk-coverage.png risk-coverage/risk-coverage.svg \
         needle/needle.md needle/traffic.md needle/needle.png needle/needle.svg needle/coverage-accuracy.png \
         danger/danger.md danger/danger.png danger/danger.svg \
         layer-pollution/layer-pollution.md layer-pollution/layer-pollution.png layer-pollution/layer-pollution.svg \
         quality/quality.md quality/quality.png quality/quality.svg \
         below8/below8.md below8/below8.csv below8/below8.png below8/below8.svg; do
  [ -s "$work/$f" ] || { echo "missing $work/$f"; exit 1; }
done
for e in soundness schemes shapes outliers risk-coverage needle danger layer-pollution quality below8; do
  grep -q "^$e: 0 soundness violations" "$work.log" || { echo "no clean verdict for $e"; cat "$work.log"; exit 1; }
done
lines=$(cat "$work"/*/results.jsonl | wc -l)
start=$(date +%s)
"$bin" eval all --quick --out "$work" > "$work.2.log" 2>&1
[ "$(cat "$work"/*/results.jsonl | wc -l)" = "$lines" ] || { echo "the rerun recomputed cells"; exit 1; }
[ $(( $(date +%s) - start )) -lt 60 ] || { echo "the rerun took too long to be a resume"; exit 1; }
if "$bin" eval soundness --quick --data /nonexistent --out "$work-x" > "$work.3.log" 2>&1; then exit 1; fi
grep -q "scripts/fetch-eval-data.sh" "$work.3.log"
if "$bin" eval nonsense --out "$work-x" > "$work.4.log" 2>&1; then exit 1; fi
grep -q "unknown experiment 'nonsense'" "$work.4.log"
echo "eval quick: $lines cells, resumed without recomputing"
