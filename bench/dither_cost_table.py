#!/usr/bin/env python3
"""The table of docs/dither-cost.md from the JSON lines of build/witcert_dither_cost.

Usage: bench/dither_cost_table.py out/dither_cost/prompt*.jsonl

Per dither mode: requests violated (any decode-step cell with true TV above its meter) in the
free-running and the teacher-forced runs, with the rule-of-three 95% upper bound on the
request-level rate when none is; cells checked and violated; coverage at the driver's tau;
the meter's median and maximum; the worst TV/meter; how many free trajectories left the fp16 one; KL(fp16 || cache) of the
next-token distribution and top-1 agreement over the forced texts.
"""
import json
import statistics
import sys
from collections import defaultdict


def rate_bound(violated, n):
    """95% upper bound on a rate: rule of three at zero, else the observed rate (stated as such)."""
    return f"< {3 / n:.3g}" if violated == 0 else f"= {violated / n:.3g} observed"


def main(paths):
    recs = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    recs[r["mode"]].append(r)
    if not recs:
        sys.exit("no records")
    rows = []
    for mode, rs in recs.items():
        n = len(rs)
        row = {"mode": mode, "requests": n}
        for run in ("free", "forced"):
            cells = sum(r[run]["cells"] for r in rs)
            row[run] = {
                "violated_requests": sum(r[run]["violations"] > 0 for r in rs),
                "cells": cells,
                "violated_cells": sum(r[run]["violations"] for r in rs),
                "coverage": sum(r[run]["covered"] for r in rs) / cells,
                "worst_ratio": max(r[run]["worst_ratio"] for r in rs),
                "max_tv": max(r[run]["max_tv"] for r in rs),
                "meter_median": statistics.median(r[run]["meter_median"] for r in rs),
                "meter_max": max(r[run]["meter_max"] for r in rs),
                "prefill_cells": sum(r[run]["prefill_cells"] for r in rs),
                "prefill_violations": sum(r[run]["prefill_violations"] for r in rs),
            }
        steps = [r["diverged_at"] for r in rs if r["diverged_at"] is not None]
        row["diverged"] = len(steps)
        row["median_divergence_step"] = statistics.median(steps) if steps else None
        positions = sum(r["quality"]["positions"] for r in rs)
        row["kl_mean"] = sum(r["quality"]["kl_mean"] * r["quality"]["positions"] for r in rs) / positions
        row["kl_max"] = max(r["quality"]["kl_max"] for r in rs)
        row["top1"] = sum(r["quality"]["top1_agree"] for r in rs) / positions
        row["positions"] = positions
        row["replay_identical"] = [r["replay_identical"] for r in rs if "replay_identical" in r]
        row["prompt_tokens"] = sorted({r["prompt_tokens"] for r in rs})
        row["decode_steps"] = sorted({r["decode_steps"] for r in rs})
        row["seconds"] = sum(r["seconds"] for r in rs)
        rows.append(row)

    print("| | " + " | ".join(r["mode"] for r in rows) + " |")
    print("| --- |" + " --- |" * len(rows))

    def line(label, f):
        print(f"| {label} | " + " | ".join(f(r) for r in rows) + " |")

    line("requests (prompts × seeds)", lambda r: str(r["requests"]))
    line("prompt tokens / decode steps", lambda r: f"{r['prompt_tokens'][0]}–{r['prompt_tokens'][-1]} / {r['decode_steps'][0]}")
    for run, label in (("free", "free-running"), ("forced", "teacher-forced")):
        line(f"{label}: violated requests", lambda r, run=run: f"{r[run]['violated_requests']} / {r['requests']} "
             f"(rate {rate_bound(r[run]['violated_requests'], r['requests'])})")
        line(f"{label}: violated cells / decode cells", lambda r, run=run: f"{r[run]['violated_cells']} / {r[run]['cells']:,}")
        line(f"{label}: coverage at τ = 0.2", lambda r, run=run: f"{r[run]['coverage']:.4f}")
        line(f"{label}: meter median (of request medians) / max",
             lambda r, run=run: f"{r[run]['meter_median']:.4f} / {r[run]['meter_max']:.4f}")
        line(f"{label}: worst TV / meter", lambda r, run=run: f"{r[run]['worst_ratio']:.3f}")
        line(f"{label}: max true TV", lambda r, run=run: f"{r[run]['max_tv']:.4f}")
        if any(r[run]["prefill_cells"] for r in rows):
            line(f"{label}: violated / checked prefill cells",
                 lambda r, run=run: f"{r[run]['prefill_violations']} / {r[run]['prefill_cells']:,}")
    line("free trajectories that left fp16's", lambda r: f"{r['diverged']} / {r['requests']}" +
         (f" (median step {r['median_divergence_step']:g})" if r["median_divergence_step"] is not None else ""))
    line("KL(fp16 ‖ cache), mean over positions", lambda r: f"{r['kl_mean']:.3g}")
    line("KL, max over positions", lambda r: f"{r['kl_max']:.3g}")
    line("top-1 agreement with fp16", lambda r: f"{r['top1']:.4f} ({r['positions']:,} positions)")
    if any(r["replay_identical"] for r in rows):
        line("free run = its trajectory forced under its own dither",
             lambda r: ", ".join("bit-identical" if x else "DIFFERENT" for x in r["replay_identical"]) or "–")
    line("driver seconds", lambda r: f"{r['seconds']:.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
