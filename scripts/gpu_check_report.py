#!/usr/bin/env python3
"""The GPU check's report (scripts/gpu-check.sh): tests.json, bench.json and sdpa.json of an output
folder combined into results.json and a markdown table, results.md. Standard library only."""
import argparse
import json
import pathlib
import sys


def load(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--tests-exit", type=int, required=True)
    parser.add_argument("--bench-exit", type=int, required=True)
    parser.add_argument("--sdpa-exit", type=int, required=True)
    parser.add_argument("--seconds", type=int, required=True)
    args = parser.parse_args()
    folder = pathlib.Path(args.folder)
    tests, bench, sdpa = load(folder / "tests.json"), load(folder / "bench.json"), load(folder / "sdpa.json")
    runs = (bench or {}).get("runs", [])
    sdpa_runs = (sdpa or {}).get("runs", [])
    copy = (bench or {}).get("copy_gbps")

    def find(fmt, meter, b, S, d, kv):
        for r in runs:
            if (r["format"], r["meter"], r["batch"], r["S"], r["d"], r["kv_heads"]) == (fmt, meter, b, S, d, kv):
                return r
        return None

    rows = []
    for b, S, d, kv in sorted({(r["batch"], r["S"], r["d"], r["kv_heads"]) for r in runs}):
        fp16 = find("fp16", False, b, S, d, kv)
        on, off = find("dither-int8", True, b, S, d, kv), find("dither-int8", False, b, S, d, kv)
        q8 = find("q8_0", True, b, S, d, kv)
        sd = next((r for r in sdpa_runs if (r["batch"], r["S"], r["d"], r["kv_heads"]) == (b, S, d, kv)), None)
        ratio = lambda x, y: x["ms"] / y["ms"] if x and y else None  # noqa: E731
        rows.append({"batch": b, "S": S, "d": d, "gqa": f"{32 // kv}:1", "fp16_ms": fp16 and fp16["ms"], "sdpa_ms": sd and sd["ms"],
                     "dither_meter_ms": on and on["ms"], "dither_no_meter_ms": off and off["ms"], "q8_0_meter_ms": q8 and q8["ms"],
                     "fp16_gbps": fp16 and fp16["gbps"], "dither_meter_gbps": on and on["gbps"],
                     "dither_meter_vs_fp16": ratio(on, fp16), "meter_on_vs_off": ratio(on, off),
                     "fp16_vs_sdpa": ratio(fp16, sd), "dither_meter_copy_fraction": on and copy and on["gbps"] / copy})
    results = {"tests": tests, "tests_exit": args.tests_exit, "bench_exit": args.bench_exit, "sdpa_exit": args.sdpa_exit,
               "device": (bench or {}).get("device"), "copy_gbps": copy, "torch": (sdpa or {}).get("torch"),
               "seconds": args.seconds, "steps": rows, "runs": runs, "sdpa_runs": sdpa_runs}
    (folder / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    f = lambda x, p=3: "—" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = ["# GPU check", "", f"Device: {results['device'] or 'unknown'}; device-to-device copy {f(copy, 0)} GB/s "
             f"(read + write); PyTorch {results['torch'] or 'not run'}; {args.seconds} s in all. "
             "Produced by `scripts/gpu-check.sh`.", ""]
    if tests:
        lines += [f"Tests: {tests['cases']} step cases, {tests['passed']} checks passed, {tests['failed']} failed, "
                  f"{tests['soundness_violations']} soundness violations; worst output error {tests['worst_output_rel_error']:.3g} "
                  f"(limit 1e-5), worst meter error {tests['worst_meter_rel_error']:.3g} (limit 1e-6).", ""]
    else:
        lines += [f"Tests: no result (exit {args.tests_exit}).", ""]
    lines += ["One decode step of one layer, 32 query heads, times in ms (CUDA events); GB/s of the cache's bytes.",
              "",
              "| B | S | d | GQA | fp16 (ours) | SDPA fp16 | dither-int8 meter | dither-int8 no meter | q8_0 meter | "
              "fp16 GB/s | dither meter GB/s | dither meter / fp16 | meter on / off | fp16 / SDPA | dither meter / copy BW |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['S']} | {r['d']} | {r['gqa']} | {f(r['fp16_ms'])} | {f(r['sdpa_ms'])} | {f(r['dither_meter_ms'])} | "
                     f"{f(r['dither_no_meter_ms'])} | {f(r['q8_0_meter_ms'])} | {f(r['fp16_gbps'], 0)} | "
                     f"{f(r['dither_meter_gbps'], 0)} | {f(r['dither_meter_vs_fp16'], 2)} | {f(r['meter_on_vs_off'], 2)} | "
                     f"{f(r['fp16_vs_sdpa'], 2)} | {f(r['dither_meter_copy_fraction'], 2)} |")
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
