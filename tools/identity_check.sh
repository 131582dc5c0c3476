#!/usr/bin/env bash
# The outputs a behaviour-preserving change must keep byte for byte: the demo's table, the
# generated text and the sorted meter JSON lines of `generate` under several formats (gated and
# not, with the soundness check). Usage: tools/identity_check.sh BINARY OUT_DIR; then compare two
# OUT_DIRs with `diff -r`.
set -euo pipefail
bin=$1
out=$2
mkdir -p "$out"
prompt="The history of the lighthouse begins with fires kept on hilltops by fishing villages. \
Over centuries the keepers learned to shield the flame, to raise it on towers of stone and to \
focus it with polished metal and later with glass lenses. Each light had its own pattern of \
flashes so that sailors could tell one headland from the next. The keeper's log recorded the \
weather, the oil burned and every ship that passed. Question: what did the keeper's log record?"
run() {
  local name=$1
  shift
  "$bin" generate --prompt "$prompt" --n 24 --threads 2 --meter-json "$out/$name.jsonl" "$@" \
    >"$out/$name.txt" 2>/dev/null
  sort "$out/$name.jsonl" -o "$out/$name.jsonl"
}
"$bin" generate --prompt "$prompt" --n 24 --threads 2 >"$out/plain.txt" 2>/dev/null
run dither-int8 --kv dither-int8
run dither-int8-gated --kv dither-int8 --gate 0.2
run q4_0 --kv q4_0
run q4_0-gated --kv q4_0 --gate 0.5 --check-soundness
run kivi-2bit --kv kivi-2bit --gate 0.2 --granularity head
run q8_0-rtn-int4 --kv q8_0 --kv-v rtn-int4
run q8_0-rtn-int4-gated --kv q8_0 --kv-v rtn-int4 --gate 0.2 --bound retention
# The demo's table without its timings, and its per-cell meters and heatmaps.
"$bin" demo --threads 2 --report "$out/demo-report" 2>/dev/null | sed -n '/^run /,$p' |
  sed -E -e 's/ +time$//' -e 's/ +[0-9.]+s$//' -e 's/ +\(total [0-9]+ s\)$//' -e '/^report: /d' >"$out/demo.txt"
find "$out/demo-report" -type f ! -name 'meter-*.jsonl' ! -name 'heatmap-*.svg' -delete
for f in "$out"/demo-report/meter-*.jsonl; do sort "$f" -o "$f"; done
