// `witcert run` and the demo: one request under a KV-cache format, optionally gated, compared
// with an fp16 run of the same tokens (paper §6.3.4, §6.3.9), and its table and report.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attention/cpu/exact_cache.h"
#include "apps/terminal.h"
#include "engine/model.h"
#include "engine/options.h"
#include "engine/session.h"
#include "formats/kv_format.h"
#include "gate/certified_cache.h"
#include "gate/telemetry.h"

namespace witcert::apps {

struct RunConfig {
  std::string label;
  engine::CacheOptions cache;  // certified: the gate's τ_V is also the V coverage threshold
  double coverage_tau = 0.2;   // the K threshold of the coverage figures
  int stride = 1;  // telemetry: keep the cells of every stride-th decode step for quantiles and JSON lines
};

struct RunOutcome {
  RunConfig config;
  std::vector<std::int32_t> tokens;  // generated (greedy, free-running), stop token excluded
  std::string text;
  double kl = 0.0;           // mean KL(p_fp16 ‖ p_run) over the generated positions, teacher-forced
  double top1 = 0.0, top5 = 0.0;  // agreement with fp16's next token
  gate::TelemetrySummary meter;
  std::vector<double> heatmap;  // mean served meter per (layer, head)
  std::string heatmap_svg;
  std::vector<gate::MeterCell> samples;  // the telemetry's sampled cells (report: meter-<i>.jsonl)
  std::int64_t page_ins = 0, page_in_bytes = 0;
  double kv_bytes_per_token = 0.0;
  double seconds = 0.0;
};

using engine::Progress;

// The fp16 reference of a request: the prompt prefilled once on the exact cache, the logits of its
// last position, and the greedy fp16 run from there. Each run_request compares against a copy of
// the prefilled cache rather than prefilling fp16 again.
struct Fp16Reference {
  std::shared_ptr<const attention::ExactKvCache> prefilled;
  std::vector<float> logits;
  RunOutcome run;
};

// The fp16 run (plain exact cache). progress(done, total) reports prefill chunks.
Fp16Reference run_fp16(const engine::Model& engine, const std::vector<std::int32_t>& prompt, int n, int threads,
                       const Progress& progress = {});

// Greedy generation of up to n tokens under `cfg`, then fp16 teacher-forced on the same tokens
// from ref (run_fp16 of the same prompt and n). Throws for an empty prompt or one that does not
// fit the context with n new tokens.
RunOutcome run_request(const engine::Model& engine, const std::vector<std::int32_t>& prompt, int n, const RunConfig& cfg,
                       int threads, const Fp16Reference& ref, const Progress& progress = {});

// A progress bar for one run's prefill: redrawn in place on a terminal, one line when done otherwise.
Progress progress_bar(std::ostream& err, const std::string& label, bool terminal = stderr_is_terminal());

// The runs as report.json holds them: the prompt, the fp16 text, and per run its formats, gate,
// bound, text, quality against fp16, meter summary (with its verdict), page-ins, bytes and time.
nlohmann::json report_json(const std::string& prompt, const RunOutcome& fp16, const std::vector<RunOutcome>& runs,
                           const std::string& answer = "");

// Writes report.json, report.md, heatmap-<i>.svg and meter-<i>.jsonl into dir (created if
// missing); with an expected answer, the table says whether each run's text contains it.
void write_report(const std::string& dir, const std::string& prompt, const RunOutcome& fp16,
                  const std::vector<RunOutcome>& runs, const std::string& answer = "");

// A table of runs, one line each, and the legend of its coverage columns.
void print_table(std::ostream& out, const std::vector<RunOutcome>& runs, const std::string& answer = "");
std::string coverage_legend(const std::vector<RunOutcome>& runs);

}  // namespace witcert::apps
