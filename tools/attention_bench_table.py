#!/usr/bin/env python3
"""Tables of docs/BENCHMARKS.md from the JSON of bench/attention_bench.cc (see its header for the
command): median CPU time per variant side by side, the ratios certified-int8/fp16 and meter
on/off, achieved GB/s against the measured read bandwidth, bytes per token and capacity.

    python3 tools/attention_bench_table.py attention.json [kv_bytes.json]
"""
import json
import re
import sys

NAME = re.compile(r"BM_DecodeAttention/variant:(\d+)/S:(\d+)/d:(\d+)/group:(\d+)/cold:(\d+)")
STREAM = re.compile(r"BM_StreamRead/bytes:(\d+)")
KVBYTES = re.compile(r"BM_KvBytes/d:(\d+)/m:(\d+)")
PAIRED = re.compile(r"BM_PairedRatio/a:(\d+)/b:(\d+)/S:(\d+)/d:(\d+)/group:(\d+)/cold:(\d+)")


def main(paths):
    runs = [r for path in paths for r in json.load(open(path))["benchmarks"]]
    medians = [r for r in runs if r.get("aggregate_name") == "median"]
    kv_bytes = {}
    for r in runs:
        m = KVBYTES.match(r["run_name"])
        if m:
            kv_bytes[tuple(map(int, m.groups()))] = r
    cells, labels, counters, stream, rotation, paired = {}, {}, {}, {}, {}, {}
    for r in medians:
        m = PAIRED.match(r["run_name"])
        if m:
            a, b, S, d, g, cold = map(int, m.groups())
            paired[(r.get("label", f"{b} / {a}"), cold, S, d, g)] = r
            continue
        m = NAME.match(r["run_name"])
        if m:
            v, S, d, g, cold = map(int, m.groups())
            cells[(cold, S, d, g, v)] = r
            labels[v] = r.get("label", str(v))
            counters[(d, v)] = (r["B/tok/head"], r["capacity_x"])
            if cold:
                n, x, lo, hi = rotation.get((S, d), (0, 0.0, float("inf"), 0.0))
                rotation[(S, d)] = (int(r["streams"]), x, min(lo, r["rotation_x_L3"]), max(hi, r["rotation_x_L3"]))
            continue
        m = STREAM.match(r["run_name"])
        if m:
            stream[int(m.group(1))] = r["GB/s"]
    by = {name: v for v, name in labels.items()}
    keys = sorted({k[:4] for k in cells})
    residency = {0: "hot", 1: "cold"}

    def f(x, spec):
        return "–" if x != x else format(x, spec)  # – : not run

    def t(k, name):
        r = cells.get(k + (by.get(name, -1),))
        return r["cpu_time"] if r else float("nan")

    def gbs(k, name):
        r = cells.get(k + (by.get(name, -1),))
        return r["GB/s"] if r else float("nan")

    if rotation:
        print("Cold rotations (bytes one rotation reads, in multiples of the L3 size, from the smallest format to "
              "fp16): " + ", ".join(f"S={S} d={d}: {n} streams, {lo:.1f}–{hi:.1f}× L3"
                                    for (S, d), (n, x, lo, hi) in sorted(rotation.items())) + "\n")

    variants = [labels[v] for v in sorted(labels)]

    def row(k):
        return f"| {residency[k[0]]} | {k[1]} | {k[2]} | {k[3]} | "

    head = "| cache | S | d | group | "
    rule = "|---|---|---|---|"
    print("Median CPU time per call (µs), one KV head's GQA group, one thread (hot: one stream in the L3; "
          "cold: a rotation of streams over several times the L3, as a decode step reads them):\n")
    print(head + " | ".join(variants) + " |")
    print(rule + "---|" * len(variants))
    for k in keys:
        print(row(k) + " | ".join(f(t(k, n), ".0f") for n in variants) + " |")

    print("\nRatios of medians (< 1: the first is faster):\n")
    ratios = [
        ("dither-int8/shared ÷ fp16", "dither-int8/shared", "fp16"),
        ("dither-int8/shared ÷ fp16 fast-kernel", "dither-int8/shared", "fp16/fast-kernel"),
        ("dither-int8/per-slot ÷ fp16", "dither-int8/per-slot", "fp16"),
        ("meter on/off dither-int8/shared", "dither-int8/shared", "dither-int8/shared/meter-off"),
        ("meter on/off dither-int8/per-slot", "dither-int8/per-slot", "dither-int8/per-slot/meter-off"),
        ("meter on/off q8_0", "q8_0", "q8_0/meter-off"),
        ("meter on/off rtn-int8", "rtn-int8", "rtn-int8/meter-off"),
        ("dither-int8/shared ÷ rtn-int8 meter off", "dither-int8/shared", "rtn-int8/meter-off"),
        ("per-slot ÷ shared dither (meter on)", "dither-int8/per-slot", "dither-int8/shared"),
    ]
    print(head + " | ".join(r[0] for r in ratios) + " |")
    print(rule + "---|" * len(ratios))
    for k in keys:
        print(row(k) + " | ".join(f(t(k, a) / t(k, b), ".3f") for _, a, b in ratios) + " |")

    if paired:
        print("\nPaired ratios (BM_PairedRatio: each iteration times one call of each variant, alternating which "
              "goes first; the median over the iterations of the per-pair ratio and its quartiles; the "
              "median of that over the repetitions):\n")
        print("| ratio | cache | S | d | group | median | quartiles | pairs |")
        print("|---|---|---|---|---|---|---|---|")
        for (label, cold, S, d, g), r in sorted(paired.items()):
            print(f"| {label} | {residency[cold]} | {S} | {d} | {g} | {r['ratio']:.3f} | "
                  f"{r['ratio_q1']:.3f}–{r['ratio_q3']:.3f} | {r['pairs']:.0f} |")

    print("\nAchieved GB/s of cache bytes read (K + V, from the KvStore allocations):\n")
    print(head + " | ".join(variants) + " |")
    print(rule + "---|" * len(variants))
    for k in keys:
        print(row(k) + " | ".join(f(gbs(k, n), ".2f") for n in variants) + " |")
    if stream:
        print("\nMeasured read bandwidth (BM_StreamRead, one thread): " +
              ", ".join(f"{b >> 20} MiB: {g:.1f} GB/s" for b, g in sorted(stream.items())))

    print("\nBytes per token per KV head (K + V, measured from the allocations) and capacity at equal memory:\n")
    formats = []
    for n in variants:
        base = n.split("/meter-off")[0]
        if base not in formats:
            formats.append(base)
    print("| format | " + " | ".join(f"d={d} B/tok/head | d={d} × fp16" for d in sorted({d for d, _ in counters})) + " |")
    print("|---|" + "---|---|" * len({d for d, _ in counters}))
    for f in formats:
        row = []
        for d in sorted({d for d, _ in counters}):
            b, x = counters[(d, by[f])]
            row += [f"{b:.2f}", f"{x:.3f}"]
        print(f"| {f} | " + " | ".join(row) + " |")


    if kv_bytes:
        print("\ndither-int8 by outlier pairs m (BM_KvBytes; K + V, measured from the allocations):\n")
        print("| d | m | K B/tok/head | V B/tok/head | K + V B/tok/head | capacity × fp16 |")
        print("|---|---|---|---|---|---|")
        for (d, m), r in sorted(kv_bytes.items()):
            print(f"| {d} | {m} | {r['K_B/tok/head']:.2f} | {r['V_B/tok/head']:.2f} | {r['B/tok/head']:.2f} | "
                  f"{r['capacity_x']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
