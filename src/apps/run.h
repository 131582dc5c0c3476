// `witcert run` and the demo: one request under a KV-cache format, optionally gated, compared
// with an fp16 run of the same tokens (paper §6.3.4, §6.3.9).
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "apps/engine.h"
#include "attn/certified_cache.h"
#include "gate/telemetry.h"

namespace witcert::apps {

struct RunConfig {
  std::string label;
  std::string kv_k = "fp16";
  std::string kv_v;  // "" → kv_k
  attn::GateOptions gate;
  int page_size = 16;
  int outliers = 4;
  double delta = 1e-2;
  double tau_report = 0.2;  // the coverage threshold of the report
  bool check_soundness = false;
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
  std::int64_t page_ins = 0, page_in_bytes = 0;
  double kv_bytes_per_token = 0.0;
  double seconds = 0.0;
};

// Greedy generation of up to n tokens under `cfg`, then fp16 teacher-forced on the same tokens.
// progress(done, total) reports prefill chunks.
RunOutcome run_request(const Engine& engine, const std::vector<std::int32_t>& prompt, int n, const RunConfig& cfg,
                       int threads, const std::function<void(std::int64_t, std::int64_t)>& progress = {});

// The fp16 run itself (plain exact cache): its tokens and text.
RunOutcome run_fp16(const Engine& engine, const std::vector<std::int32_t>& prompt, int n, int threads);

// Writes report.json, report.md and heatmap-<label>.svg into dir (created if missing).
void write_report(const std::string& dir, const std::string& prompt, const RunOutcome& fp16,
                  const std::vector<RunOutcome>& runs);

// A table of runs, one line each.
void print_table(std::ostream& out, const std::vector<RunOutcome>& runs, const std::string& answer = "");

}  // namespace witcert::apps
