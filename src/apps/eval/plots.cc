// The plots of `witcert eval`, drawn by matplotlib (pinned in scripts/install-deps.sh) from the
// experiment's CSVs. The script is part of the binary, written beside the results for the run, so
// an installed `witcert` needs no file of the source tree.
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>

#include "apps/eval/eval.h"

namespace witcert::apps::eval {

namespace {

constexpr const char* kScript = R"PY(
import csv, math, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

experiment, out = sys.argv[1], sys.argv[2]
written = []

def rows(name):
    with open(f"{out}/{name}.csv", newline="") as f:
        return list(csv.DictReader(f))

def num(s):
    return math.inf if s == "inf" else float(s)

def save(fig, name, legend_below=0.0):
    # legend_below: the fraction of the figure's height kept under the axes for a shared legend.
    fig.tight_layout(rect=(0, legend_below, 1, 1))
    for ext in ("png", "svg"):
        path = f"{out}/{name}.{ext}"
        fig.savefig(path, dpi=120)
        written.append(path)
    plt.close(fig)

def shared_legend(fig, axes, ncol):
    # One legend under all panels, built from the first panel's entries and any others' new ones.
    seen = {}
    for ax in axes:
        for h, l in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(l, h)
    fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=ncol, fontsize=7, frameon=False)

# The schemes in families, one panel each where a plot would otherwise overdraw 16-19 schemes.
FAMILIES = (
    ("dithered (Tier B)", lambda s: s.startswith("dither-")),
    ("llama.cpp blocks", lambda s: s in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")),
    ("fp8", lambda s: s.startswith("fp8-")),
    ("round to nearest", lambda s: s.startswith("rtn-") or s == "sign-1bit"),
    ("rotation, KIVI, KVQuant", lambda s: True),
)

def family(s):
    return next(name for name, member in FAMILIES if member(s))

def family_colour(name):  # one colour per family in every plot
    return COLOURS[[n for n, _ in FAMILIES].index(name)]

def by_family(schemes):
    groups = {}
    for s in sorted(schemes):
        groups.setdefault(family(s), []).append(s)
    return [(name, groups[name]) for name, _ in FAMILIES if name in groups]

def panels(n, width=3.7, height=3.4, sharey=True):
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False, sharey=sharey)
    return fig, list(axes[0])

COLOURS = plt.cm.tab10.colors

def place_labels(ax, pts, fontsize=6):
    # Labels (x, y, text) next to their points without overlapping each other or the points: each
    # takes the first free spot of a spiral of offsets, joined to its point by a thin line when far.
    fig = ax.figure
    fig.canvas.draw()
    scale = fig.dpi / 72.0
    bbox = ax.get_window_extent()
    marks = [tuple(ax.transData.transform((x, y))) for x, y, _ in pts]
    boxes = []
    def free(b):
        x0, y0, x1, y1 = b
        if x0 < bbox.x0 or x1 > bbox.x1 or y0 < bbox.y0 or y1 > bbox.y1:
            return False
        if any(x0 < c[2] and c[0] < x1 and y0 < c[3] and c[1] < y1 for c in boxes):
            return False
        return not any(x0 - 2 < mx < x1 + 2 and y0 - 2 < my < y1 + 2 for mx, my in marks)
    offsets = [(dx, dy) for r in (4, 10, 18, 28, 40, 54) for dx, dy in
               ((r, r * 0.3), (r, -r), (-r, r * 0.3), (-r, -r), (0, r + 2), (0, -r - 8))]
    for (x, y, text), (mx, my) in sorted(zip(pts, marks), key=lambda p: (p[1][1], p[1][0])):
        w = 0.56 * fontsize * scale * len(text)
        h = 1.2 * fontsize * scale
        for dx, dy in offsets:
            x0 = mx + dx * scale - (w if dx < 0 else 0)
            y0 = my + dy * scale
            b = (x0, y0, x0 + w, y0 + h)
            if free(b):
                break
        boxes.append(b)
        far = abs(dx) > 12 or abs(dy) > 12
        ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                    ha="right" if dx < 0 else "left", va="bottom",
                    arrowprops=dict(arrowstyle="-", lw=0.4, color="gray") if far else None)

if experiment == "soundness":
    r = rows("ratios")
    fig, ax = plt.subplots(figsize=(8, 4.8))
    groups = by_family({x["scheme"] for x in r})
    data = [[num(x["worst_ratio"]) for x in r if family(x["scheme"]) == name] for name, _ in groups]
    labels = [f"{name} ({len(members)}: {', '.join(members)})" if len(members) <= 3 else f"{name} ({len(members)} caches)"
              for name, members in groups]
    # Edges on multiples of 0.05, so that no bin straddles 1 (a ratio of 0.9999 is not a violation).
    ax.hist(data, bins=[i * 0.05 for i in range(22)], stacked=True, label=labels, color=[family_colour(name) for name, _ in groups])
    ax.axvline(1.0, color="red", linestyle="--", label="violation (TV > meter)")
    ax.set_xlim(0, 1.1)
    ax.set_title(f"Soundness: worst true TV / meter of each of {len(r)} requests")
    ax.set_xlabel("worst true TV / meter in the request (dimensionless; > 1 is a violation)")
    ax.set_ylabel("requests")
    shared_legend(fig, [ax], 2)
    save(fig, "soundness", legend_below=0.16)

if experiment == "schemes":
    r = rows("cells")
    groups = by_family({x["scheme"] for x in r})
    lo, hi = 1e-5, 1e3
    clip = lambda v: min(max(v, lo), hi)
    fig, axes = panels(len(groups))
    context = [(clip(num(x["raw"])), clip(num(x["tv"]))) for x in r]
    context = context[::max(1, len(context) // 20000)]
    for ax, (name, members) in zip(axes, groups):
        ax.scatter([p[0] for p in context], [p[1] for p in context], s=2, color="0.88", rasterized=True,
                   label="every scheme")
        for i, s in enumerate(members):
            pts = [(clip(num(x["raw"])), clip(num(x["tv"]))) for x in r if x["scheme"] == s]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=3, alpha=0.5, color=COLOURS[i], rasterized=True, label=s)
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="bound = TV")
        ax.set_xscale("log"); ax.set_yscale("log")
        ax.set_xlim(lo, hi); ax.set_ylim(lo, 1.5)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("raw meter (TV bound, unclamped)", fontsize=8)
        ax.legend(fontsize=6, markerscale=3, loc="lower right")
    axes[0].set_ylabel("true TV(p, p~)")
    fig.suptitle(f"Raw meter against the true TV per (layer, head, step) cell; values outside [{lo:g}, {hi:g}] drawn at the edge",
                 fontsize=9)
    save(fig, "scatter")

    fig, axes = panels(len(groups))
    for ax, (name, members) in zip(axes, groups):
        drawn = False
        for i, s in enumerate(members):
            cells = [(num(x["raw"]), num(x["tv"]) > 0.2) for x in r if x["scheme"] == s]
            pos = sum(1 for c in cells if c[1]); neg = len(cells) - pos
            if pos == 0 or neg == 0:
                ax.plot([], [], color=COLOURS[i], label=f"{s}: no cell above 0.2" if pos == 0 else f"{s}: every cell above")
                continue
            cells.sort(key=lambda c: -c[0])
            tp = fp = 0; xs = [0.0]; ys = [0.0]
            for _, d in cells:
                if d: tp += 1
                else: fp += 1
                xs.append(fp / neg); ys.append(tp / pos)
            ax.plot(xs, ys, color=COLOURS[i], label=s)
            drawn = True
        ax.plot([0, 1], [0, 1], color="gray", linestyle=":", label="chance")
        ax.set_xlim(0, 1); ax.set_ylim(0, 1.02)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("false positive rate", fontsize=8)
        ax.legend(fontsize=6, loc="lower right")
    axes[0].set_ylabel("true positive rate")
    fig.suptitle("Raw score as a classifier of danger (true TV > 0.2)", fontsize=9)
    save(fig, "roc")

    # Tightness on [0.8, 10^4]: the share of cells beyond is in the legend, not on a 10^10 axis.
    top = 1e4
    fig, axes = panels(len(groups))
    for ax, (name, members) in zip(axes, groups):
        for i, s in enumerate(members):
            t = sorted(num(x["meter"]) / num(x["tv"]) for x in r if x["scheme"] == s and num(x["tv"]) > 1e-12)
            if not t:
                continue
            beyond = sum(1 for v in t if v > top) / len(t)
            label = s + (f" ({100 * beyond:.1f} % > 1e4)" if beyond >= 0.0005 else "")
            ax.plot([min(v, top) for v in t], [(k + 1) / len(t) for k in range(len(t))], color=COLOURS[i], label=label)
        ax.axvline(1.0, color="red", linestyle="--", label="meter = TV")
        ax.set_xscale("log"); ax.set_xlim(0.8, top); ax.set_ylim(0, 1.02)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("meter / true TV (>= 1 when sound)", fontsize=8)
        ax.legend(fontsize=6, loc="lower right")
    axes[0].set_ylabel("fraction of cells (cumulative)")
    fig.suptitle("Tightness: meter / true TV per cell (cells with TV > 1e-12)", fontsize=9)
    save(fig, "tightness")

if experiment == "shapes":
    r = rows("shapes")
    schemes = list(dict.fromkeys(x["scheme"] for x in r))
    bounds = list(dict.fromkeys(x["bound"] for x in r))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    width = 0.8 / len(schemes)
    for i, s in enumerate(schemes):
        sub = {x["bound"]: x for x in r if x["scheme"] == s}
        xs = [j + i * width for j in range(len(bounds))]
        axes[0].bar(xs, [float(sub[b]["K coverage at 0.2"]) for b in bounds], width, color=COLOURS[i], label=s)
        axes[1].bar(xs, [float(sub[b]["gated page-in KiB per request"]) for b in bounds], width, color=COLOURS[i], label=s)
    for ax in axes:
        ax.set_xticks([j + width * (len(schemes) - 1) / 2 for j in range(len(bounds))])
        ax.set_xticklabels(bounds)
        ax.set_xlabel("bound shape")
    axes[0].set_ylim(0, 1.02)
    axes[0].set_title("K coverage at tau = 0.2, no gate")
    axes[0].set_ylabel("fraction of decode cells with meter <= 0.2")
    axes[1].set_title("Page-in of a gate at tau = 0.2")
    axes[1].set_ylabel("KiB read from the exact tier per request")
    shared_legend(fig, axes[:1], len(schemes))
    save(fig, "shapes", legend_below=0.08)

if experiment == "outliers":
    r = rows("outliers")
    ms = [int(x["m"]) for x in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ms, [float(x["K coverage (min)"]) for x in r], marker="o", label="K coverage, min of sound forms")
    ax.plot(ms, [float(x["K coverage (e-form)"]) for x in r], marker="s", label="K coverage, e-form")
    pm = [(int(x["m"]), float(x["paper e-form (Qwen2.5-7B)"])) for x in r if x["paper e-form (Qwen2.5-7B)"]]
    ax.plot([p[0] for p in pm], [p[1] for p in pm], marker="^", linestyle="--", label="paper, e-form (Qwen2.5-7B)")
    ax.set_ylim(0, 1.05)
    ax.set_title("dither-int8: coverage at tau = 0.2 against the outlier budget")
    ax.set_xlabel("m, RoPE pairs kept exact per KV head")
    ax.set_ylabel("fraction of decode cells with K meter <= 0.2")
    ax2 = ax.twinx()
    ax2.plot(ms, [float(x["B/tok/head (K+V)/2"]) for x in r], color="gray", linestyle=":", label="bytes")
    ax2.set_ylabel("bytes per token and head (mean of K and V)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + ["bytes per token and head (right axis)"], fontsize=7, loc="lower right")
    save(fig, "outliers")

if experiment == "below8":
    r = rows("below8")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    labels = {ax: [] for ax in axes}
    series = 0
    for m in ("0", "4"):
        for values, scales in ((False, "token"), (True, "token"), (False, "channel")):
            pts = sorted((num(x["capacity x fp16"]), num(x["joint coverage prose"]), num(x["joint coverage code"]),
                          x["format"]) for x in r
                         if x["m"] == m and (x["values"] != "fp16") == values and x.get("key scales", "token") == scales)
            if not pts:
                continue
            label = f"m = {m}, " + ("keys and values dithered" if values else "keys dithered, fp16 values")
            if scales == "channel":
                label += ", channel scales"
            for ax, col in ((axes[0], 1), (axes[1], 2)):
                ax.plot([p[0] for p in pts], [p[col] for p in pts], marker="o", color=COLOURS[series], label=label)
                labels[ax] += [(p[0], p[col], p[3].replace("dither-", "")) for p in pts]
            series += 1
    for ax, domain in ((axes[0], "prose"), (axes[1], "code")):
        ax.axhline(0.9, color="gray", linestyle=":", label="coverage 0.9")
        ax.set_ylim(-0.03, 1.08)
        ax.set_xlim(1.0, max(p[0] for p in labels[ax]) + 0.4)
        ax.set_title(f"Capacity against certified coverage ({domain})")
        ax.set_xlabel("capacity against fp16 (fp16 bytes / bytes per token, measured)")
        place_labels(ax, labels[ax])
    axes[0].set_ylabel("joint coverage at tau_K 0.2 / tau_V 0.05")
    shared_legend(fig, axes[:1], 4)
    save(fig, "below8", legend_below=0.14)

if experiment == "risk-coverage":
    r = rows("curve")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for m, ax in zip(("0", "4"), axes):
        for dom in dict.fromkeys(x["domain"] for x in r):
            pts = [x for x in r if x["domain"] == dom and x["m"] == m and float(x["delta"]) > 0]
            pts.sort(key=lambda x: float(x["delta"]))
            colour = {"prose": "tab:blue", "code": "tab:green", "needle": "tab:orange"}.get(dom, "black")
            ax.plot([float(x["delta"]) for x in pts], [float(x["coverage"]) for x in pts], marker="o", color=colour, label=f"{dom}, default shape")
            ax.plot([float(x["delta"]) for x in pts], [float(x["coverage_eform"]) for x in pts], marker="s", linestyle="--",
                    color=colour, label=f"{dom}, e-form")
            t = [x for x in r if x["domain"] == dom and x["m"] == m and float(x["delta"]) == 0]
            if t:
                ax.axhline(float(t[0]["coverage"]), color=colour, linestyle=":", label=f"{dom}, tanh (delta = 0)")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"Risk-coverage, dither-int8, m = {m}")
        ax.set_xlabel("request failure budget delta (log)")
    axes[0].set_ylabel("joint K and V coverage of decode cells\n(tau_K 0.2, tau_V 0.05)")
    shared_legend(fig, axes, 3)
    save(fig, "risk-coverage", legend_below=0.16)

if experiment == "needle":
    r = [x for x in rows("needle")]
    labels = [x["configuration"] + ("" if x["prompts"] == r[0]["prompts"] else f' ({x["prompts"]} prompts)') for x in r]
    acc = [float(x["accuracy"]) for x in r]
    base = acc[0]
    lo = [float(x["fp16 on them"]) + float(x["95% CI low"]) for x in r]
    hi = [float(x["fp16 on them"]) + float(x["95% CI high"]) for x in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.4), sharey=True)
    ys = list(range(len(r)))
    axes[0].barh(ys, acc, color=["gray" if "raw" in l or l == "fp16" else "tab:green" for l in labels])
    axes[0].errorbar(acc, ys, xerr=[[max(0.0, a - l) for a, l in zip(acc, lo)], [max(0.0, h - a) for a, h in zip(acc, hi)]],
                     fmt="none", color="black", capsize=2, label="95% paired bootstrap interval vs fp16")
    axes[0].set_yticks(ys); axes[0].set_yticklabels(labels, fontsize=7); axes[0].invert_yaxis()
    axes[0].axvline(base, color="red", linestyle="--", label="fp16's accuracy")
    axes[0].set_xlim(0, 1.05)
    axes[0].set_title("Needle accuracy, raw (gray) and gated (green)")
    axes[0].set_xlabel("fraction of prompts answered")
    p50 = [float(x["page-in P50 KiB"]) for x in r]
    p95 = [float(x["page-in P95 KiB"]) for x in r]
    axes[1].barh(ys, p95, color="lightgray", label="page-in P95")
    axes[1].barh(ys, p50, color="tab:blue", label="page-in P50")
    axes[1].set_title("Page-in per request")
    axes[1].set_xlabel("KiB read from the exact tier per request")
    shared_legend(fig, axes, 4)
    save(fig, "needle", legend_below=0.07)

    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    pts = []
    for x in r:
        if x["configuration"] == "fp16":
            continue
        gated = x["gate"] != "–"
        ax.scatter(float(x["coverage at 0.2"]), float(x["accuracy"]), marker="^" if gated else "o",
                   color="tab:green" if gated else "gray")
        pts.append((float(x["coverage at 0.2"]), float(x["accuracy"]), x["configuration"]))
    ax.scatter([], [], marker="o", color="gray", label="raw cache")
    ax.scatter([], [], marker="^", color="tab:green", label="gated")
    ax.set_xlim(-0.05, 1.3); ax.set_ylim(-0.05, 1.1)
    ax.set_title("Coverage (online) against accuracy (ground truth)")
    ax.set_xlabel("joint coverage at tau = 0.2 of decode cells, as served")
    ax.set_ylabel("needle accuracy")
    ax.legend(fontsize=7, loc="lower right")
    place_labels(ax, pts)
    save(fig, "coverage-accuracy")

if experiment == "danger":
    r = [x for x in rows("danger")]
    labels = [x["scheme"] for x in r]
    ys = list(range(len(r)))
    fig, ax = plt.subplots(figsize=(8, 6.3))
    ax.barh([y - 0.2 for y in ys], [float(x["danger rate (TV > 0.2)"]) for x in r], 0.4, color="tab:red", label="danger rate (true TV > 0.2)")
    ax.barh([y + 0.2 for y in ys], [float(x["needle accuracy"]) for x in r], 0.4, color="tab:blue", label="needle accuracy")
    ax.set_yticks(ys); ax.set_yticklabels(labels, fontsize=7); ax.invert_yaxis()
    ax.set_xlim(0, 1.05)
    ax.set_title("Per-step danger against end-task accuracy, raw caches")
    ax.set_xlabel("fraction (of decode cells, or of prompts)")
    shared_legend(fig, [ax], 2)
    save(fig, "danger", legend_below=0.05)

if experiment == "layer-pollution":
    r = [x for x in rows("layer-pollution") if int(x["layer"]) >= 0]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([int(x["layer"]) for x in r], [float(x["KL/token vs fp16"]) for x in r], color="tab:purple", label="KL per token")
    allrow = [x for x in rows("layer-pollution") if int(x["layer"]) == -1]
    if allrow:
        ax.axhline(float(allrow[0]["KL/token vs fp16"]), color="red", linestyle="--", label="kivi-2bit in every layer")
    ax.set_yscale("log")
    ax.set_title("Layer pollution: kivi-2bit in one layer, the others exact")
    ax.set_xlabel("layer holding kivi-2bit")
    ax.set_ylabel("KL(fp16 || run) per token, nats (log)")
    ax.legend(fontsize=7)
    save(fig, "layer-pollution")

if experiment == "quality":
    r = rows("quality")
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5), sharey=True)
    for ax, dom in zip(axes, ("prose", "code")):
        pts = [x for x in r if x["domain"] == dom and x["cache"] != "fp16"]
        for x in pts:
            ablation = x["cache"].startswith("ablation")
            ax.scatter(float(x["B/token/head (K+V)/2"]), max(float(x["KL/token vs fp16"]), 1e-7),
                       color="black" if ablation else family_colour(family(x["cache"])), marker="x" if ablation else "o")
        ax.set_yscale("log")
        xs = [float(x["B/token/head (K+V)/2"]) for x in pts]
        ax.set_xlim(min(xs) - 8, max(xs) + 12)
        ax.set_title(f"Teacher-forced KL against fp16 ({dom})")
        ax.set_xlabel("bytes per token and head (mean of K and V)")
        place_labels(ax, [(float(x["B/token/head (K+V)/2"]), max(float(x["KL/token vs fp16"]), 1e-7), x["cache"]) for x in pts])
    for name, _ in FAMILIES:
        axes[0].scatter([], [], color=family_colour(name), marker="o", label=name)
    axes[0].scatter([], [], color="black", marker="x", label="ablations of dither-int8")
    axes[0].set_ylabel("KL(fp16 || run) per token, nats (log)")
    shared_legend(fig, axes[:1], 6)
    save(fig, "quality", legend_below=0.06)

print("\n".join(written))
)PY";

std::string interpreter(const EvalOptions& o) {
  if (!o.python.empty()) return o.python;
  if (const char* env = std::getenv("WITCERT_PYTHON")) return env;
  if (std::filesystem::exists(".venv/bin/python")) return ".venv/bin/python";
  return "python3";
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

std::vector<std::string> draw_plots(const EvalOptions& o, const std::string& experiment, const std::string& dir) {
  const std::string py = interpreter(o);
  const std::string script = (std::filesystem::path(dir) / ".plots.py").string();
  {
    std::FILE* f = std::fopen(script.c_str(), "w");
    if (!f) throw std::runtime_error("cannot write " + script);
    std::fputs(kScript, f);
    std::fclose(f);
  }
  const std::string cmd = fmt::format("{} {} {} {} 2>&1", shell_quote(py), shell_quote(script), shell_quote(experiment),
                                      shell_quote(dir));
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("cannot run " + py);
  std::string output;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) output += buf;
  const int rc = pclose(p);
  std::filesystem::remove(script);
  if (rc != 0)
    throw std::runtime_error(fmt::format("the plots need matplotlib (scripts/install-deps.sh puts it in .venv; "
                                         "--python or WITCERT_PYTHON names another interpreter): {} said:\n{}",
                                         py, output));
  std::vector<std::string> files;
  std::istringstream lines(output);
  for (std::string l; std::getline(lines, l);)
    if (!l.empty()) files.push_back(l);
  return files;
}

}  // namespace witcert::apps::eval
