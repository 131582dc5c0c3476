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
plt.rcParams["axes.prop_cycle"] = plt.cycler(color=plt.cm.tab20.colors)  # 16 schemes, 16 colours

experiment, out = sys.argv[1], sys.argv[2]
written = []

def rows(name):
    with open(f"{out}/{name}.csv", newline="") as f:
        return list(csv.DictReader(f))

def num(s):
    return math.inf if s == "inf" else float(s)

def save(fig, name):
    fig.tight_layout()
    for ext in ("png", "svg"):
        path = f"{out}/{name}.{ext}"
        fig.savefig(path, dpi=120)
        written.append(path)
    plt.close(fig)

if experiment == "soundness":
    r = rows("ratios")
    fig, ax = plt.subplots(figsize=(7, 4))
    schemes = sorted({x["scheme"] for x in r})
    data = [[num(x["worst_ratio"]) for x in r if x["scheme"] == s] for s in schemes]
    # Edges on multiples of 0.05, so that no bin straddles 1 (a ratio of 0.9999 is not a violation).
    ax.hist(data, bins=[i * 0.05 for i in range(22)], stacked=True, label=schemes)
    ax.axvline(1.0, color="red", linestyle="--", label="violation (TV > meter)")
    ax.set_title("Soundness: worst true TV / meter of each request")
    ax.set_xlabel("worst true TV / meter in the request (dimensionless; > 1 is a violation)")
    ax.set_ylabel("requests")
    ax.legend(fontsize=6, ncol=2)
    save(fig, "soundness")

if experiment == "schemes":
    r = rows("cells")
    schemes = sorted({x["scheme"] for x in r})
    floor = 1e-7
    fig, ax = plt.subplots(figsize=(7, 6))
    for s in schemes:
        pts = [(max(num(x["raw"]), floor), max(num(x["tv"]), floor)) for x in r if x["scheme"] == s and num(x["raw"]) < math.inf]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=3, alpha=0.5, label=s)
    ax.plot([floor, 1e3], [floor, 1e3], color="black", linewidth=1, label="y = x (bound = TV)")
    ax.set_xscale("log"); ax.set_yscale("log")
    ax.set_xlim(floor, 1e3); ax.set_ylim(floor, 1.5)
    ax.set_title("Raw meter (e-form) against the true TV, per (layer, head, step) cell")
    ax.set_xlabel(f"raw meter, unclamped (TV bound; values below {floor:g} drawn at it)")
    ax.set_ylabel("true TV(p, p~)")
    ax.legend(fontsize=6, ncol=2, markerscale=3)
    save(fig, "scatter")

    fig, ax = plt.subplots(figsize=(6, 6))
    for s in schemes:
        cells = [(num(x["raw"]), num(x["tv"]) > 0.2) for x in r if x["scheme"] == s]
        pos = sum(1 for c in cells if c[1]); neg = len(cells) - pos
        if pos == 0 or neg == 0:
            continue
        cells.sort(key=lambda c: -c[0])
        tp = fp = 0; xs = [0.0]; ys = [0.0]
        for _, d in cells:
            if d: tp += 1
            else: fp += 1
            xs.append(fp / neg); ys.append(tp / pos)
        ax.plot(xs, ys, label=s)
    ax.plot([0, 1], [0, 1], color="gray", linestyle=":", label="chance")
    ax.set_title("Raw score as a classifier of danger (true TV > 0.2)")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.legend(fontsize=6)
    save(fig, "roc")

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in schemes:
        t = sorted(num(x["meter"]) / num(x["tv"]) for x in r if x["scheme"] == s and num(x["tv"]) > 1e-12)
        if t:
            ax.plot(t, [(i + 1) / len(t) for i in range(len(t))], label=s)
    ax.set_xscale("log")
    ax.axvline(1.0, color="red", linestyle="--", label="meter = TV")
    ax.set_title("Tightness: meter / true TV per cell (cumulative)")
    ax.set_xlabel("meter / true TV (dimensionless, >= 1 when sound)")
    ax.set_ylabel("fraction of cells")
    ax.legend(fontsize=6, ncol=2)
    save(fig, "tightness")

if experiment == "shapes":
    r = rows("shapes")
    schemes = list(dict.fromkeys(x["scheme"] for x in r))
    bounds = list(dict.fromkeys(x["bound"] for x in r))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(schemes)
    for i, s in enumerate(schemes):
        sub = {x["bound"]: x for x in r if x["scheme"] == s}
        xs = [j + i * width for j in range(len(bounds))]
        axes[0].bar(xs, [float(sub[b]["K coverage at 0.2"]) for b in bounds], width, label=s)
        axes[1].bar(xs, [float(sub[b]["gated page-in KiB per request"]) for b in bounds], width, label=s)
    for ax in axes:
        ax.set_xticks([j + width * (len(schemes) - 1) / 2 for j in range(len(bounds))])
        ax.set_xticklabels(bounds)
        ax.set_xlabel("bound shape")
        ax.legend(fontsize=7)
    axes[0].set_title("K coverage at tau = 0.2, no gate")
    axes[0].set_ylabel("fraction of decode cells with meter <= 0.2")
    axes[1].set_title("Page-in of a gate at tau = 0.2")
    axes[1].set_ylabel("KiB read from the exact tier per request")
    save(fig, "shapes")

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
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m in ("0", "4"):
        for values in (False, True):
            pts = sorted((num(x["capacity x fp16"]), num(x["joint coverage prose"]), num(x["joint coverage code"]),
                          x["format"]) for x in r if x["m"] == m and (x["values"] != "fp16") == values)
            label = f"m = {m}, " + ("keys and values dithered" if values else "keys dithered, fp16 values")
            for ax, col in ((axes[0], 1), (axes[1], 2)):
                ax.plot([p[0] for p in pts], [p[col] for p in pts], marker="o", label=label)
                for p in pts:
                    ax.annotate(p[3].replace("dither-", ""), (p[0], p[col]), fontsize=6, textcoords="offset points",
                                xytext=(3, 3))
    for ax, domain in ((axes[0], "prose"), (axes[1], "code")):
        ax.axhline(0.9, color="gray", linestyle=":", label="coverage 0.9")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"Capacity against certified coverage ({domain})")
        ax.set_xlabel("capacity against fp16 (fp16 bytes / bytes per token, measured)")
        ax.set_ylabel("joint coverage at tau_K 0.2 / tau_V 0.05")
    axes[0].legend(fontsize=7, loc="lower left")
    save(fig, "below8")

if experiment == "risk-coverage":
    r = rows("curve")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for m, ax in zip(("0", "4"), axes):
        for dom in dict.fromkeys(x["domain"] for x in r):
            pts = [x for x in r if x["domain"] == dom and x["m"] == m and float(x["delta"]) > 0]
            pts.sort(key=lambda x: float(x["delta"]))
            colour = {"prose": "tab:blue", "code": "tab:green", "needle": "tab:orange"}.get(dom, "black")
            line, = ax.plot([float(x["delta"]) for x in pts], [float(x["coverage"]) for x in pts], marker="o", color=colour, label=f"{dom}, default shape")
            ax.plot([float(x["delta"]) for x in pts], [float(x["coverage_eform"]) for x in pts], marker="s", linestyle="--",
                    color=line.get_color(), label=f"{dom}, e-form")
            t = [x for x in r if x["domain"] == dom and x["m"] == m and float(x["delta"]) == 0]
            if t:
                ax.axhline(float(t[0]["coverage"]), color=line.get_color(), linestyle=":", label=f"{dom}, tanh (delta = 0)")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"Risk-coverage, dither-int8, m = {m}")
        ax.set_xlabel("request failure budget delta (log)")
        ax.set_ylabel("joint K and V coverage of decode cells (tau_K 0.2, tau_V 0.05)")
        ax.legend(fontsize=6)
    save(fig, "risk-coverage")

if experiment == "needle":
    r = [x for x in rows("needle")]
    labels = [x["configuration"] + ("" if x["prompts"] == r[0]["prompts"] else f' ({x["prompts"]} prompts)') for x in r]
    acc = [float(x["accuracy"]) for x in r]
    base = acc[0]
    lo = [float(x["fp16 on them"]) + float(x["95% CI low"]) for x in r]
    hi = [float(x["fp16 on them"]) + float(x["95% CI high"]) for x in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ys = list(range(len(r)))
    axes[0].barh(ys, acc, color=["gray" if "raw" in l or l == "fp16" else "tab:green" for l in labels])
    axes[0].errorbar(acc, ys, xerr=[[max(0.0, a - l) for a, l in zip(acc, lo)], [max(0.0, h - a) for a, h in zip(acc, hi)]],
                     fmt="none", color="black", capsize=2, label="95% paired bootstrap interval vs fp16")
    axes[0].set_yticks(ys); axes[0].set_yticklabels(labels, fontsize=7); axes[0].invert_yaxis()
    axes[0].axvline(base, color="red", linestyle="--", label="fp16")
    axes[0].set_xlim(0, 1.05)
    axes[0].set_title("Needle accuracy, raw (gray) and gated (green)")
    axes[0].set_xlabel("fraction of prompts answered")
    axes[0].legend(fontsize=7, loc="lower right")
    p50 = [float(x["page-in P50 KiB"]) for x in r]
    p95 = [float(x["page-in P95 KiB"]) for x in r]
    axes[1].barh(ys, p95, color="lightgray", label="P95")
    axes[1].barh(ys, p50, color="tab:blue", label="P50")
    axes[1].set_yticks(ys); axes[1].set_yticklabels(labels, fontsize=7); axes[1].invert_yaxis()
    axes[1].set_title("Page-in per request")
    axes[1].set_xlabel("KiB read from the exact tier per request")
    axes[1].legend(fontsize=7)
    save(fig, "needle")

    fig, ax = plt.subplots(figsize=(6, 5))
    for x in r:
        if x["configuration"] == "fp16":
            continue
        ax.scatter(float(x["coverage at 0.2"]), float(x["accuracy"]), marker="o" if x["gate"] == "–" else "^")
        ax.annotate(x["configuration"], (float(x["coverage at 0.2"]), float(x["accuracy"])), fontsize=6)
    ax.set_xlim(-0.02, 1.05); ax.set_ylim(-0.02, 1.05)
    ax.set_title("Coverage (online) against accuracy (ground truth)")
    ax.set_xlabel("joint coverage at tau = 0.2 of decode cells, as served")
    ax.set_ylabel("needle accuracy")
    save(fig, "coverage-accuracy")

if experiment == "danger":
    r = [x for x in rows("danger")]
    labels = [x["scheme"] for x in r]
    ys = list(range(len(r)))
    fig, ax = plt.subplots(figsize=(8, 6))
    ax.barh([y - 0.2 for y in ys], [float(x["danger rate (TV > 0.2)"]) for x in r], 0.4, color="tab:red", label="danger rate (true TV > 0.2)")
    ax.barh([y + 0.2 for y in ys], [float(x["needle accuracy"]) for x in r], 0.4, color="tab:blue", label="needle accuracy")
    ax.set_yticks(ys); ax.set_yticklabels(labels, fontsize=7); ax.invert_yaxis()
    ax.set_xlim(0, 1.05)
    ax.set_title("Per-step danger against end-task accuracy, raw caches")
    ax.set_xlabel("fraction (of decode cells, or of prompts)")
    ax.legend(fontsize=7)
    save(fig, "danger")

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
    fig, ax = plt.subplots(figsize=(9, 6))
    for dom, mk in (("prose", "o"), ("code", "s")):
        pts = [x for x in r if x["domain"] == dom and x["cache"] != "fp16"]
        ax.scatter([float(x["B/token/head (K+V)/2"]) for x in pts], [max(float(x["KL/token vs fp16"]), 1e-7) for x in pts], marker=mk, label=dom)
        for x in pts:
            ax.annotate(x["cache"], (float(x["B/token/head (K+V)/2"]), max(float(x["KL/token vs fp16"]), 1e-7)), fontsize=5)
    ax.set_yscale("log")
    ax.set_title("Teacher-forced KL against fp16 by bytes per token")
    ax.set_xlabel("bytes per token and head (mean of K and V)")
    ax.set_ylabel("KL(fp16 || run) per token, nats (log)")
    ax.legend(fontsize=7)
    save(fig, "quality")

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
