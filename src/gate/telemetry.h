// Telemetry of the meter (DESIGN §2, layer 6): per (layer, query head) aggregates, coverage at
// τ, raw-score quantiles, overflow and repair counts, written as JSON, JSON lines and a heatmap image.
#pragma once

#include <cstdint>
#include <mutex>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/certified_cache.h"

namespace witcert::gate {

struct TelemetrySummary {
  std::int64_t cells = 0;
  double coverage = 0.0;  // fraction of cells with meter ≤ τ (as served, after any repair)
  double coverage_before = 0.0;  // the same on the raw score before repair, clamped
  double raw_p50 = 0.0, raw_p90 = 0.0, raw_p99 = 0.0, raw_max = 0.0;  // before repair
  std::int64_t overflow = 0;  // raw = +inf
  std::int64_t repaired = 0;
  std::int64_t checked = 0, violations = 0;  // soundness against the true TV, where computed
  nlohmann::json to_json() const;
};

// Aggregates the served cells of one request in place, as the cache serves them (it is the
// cache's MeterSink): counts, coverage, overflow, repairs and the per-(layer, head) mean meter over
// every decode-step cell; the cells of every stride-th decode step are kept as samples, from which
// come the raw-score quantiles and the JSON lines. Memory is bounded by (layers × heads) plus the
// samples, whatever the request's length.
class Telemetry final : public attn::MeterSink {
 public:
  // Cells at positions < first_pos (the prompt) are not counted; a cell's decode step is
  // pos − first_pos. Throws std::invalid_argument for no layers or heads, τ ≤ 0 or stride < 1.
  Telemetry(int layers, int heads, double tau, std::int64_t first_pos = 0, int stride = 1);

  // Thread-safe; called by the cache with the cells of each attention call.
  void record(std::span<const attn::MeterCell> cells) override;

  TelemetrySummary summary() const;
  // The sampled cells, in the order they were served.
  std::vector<attn::MeterCell> samples() const;
  // Mean served meter per (layer, head), row-major [layer][head].
  std::vector<double> heatmap() const;
  // An SVG heatmap: layers down, heads across, colour = mean meter in [0, 1].
  std::string heatmap_svg(const std::string& title) const;

 private:
  int layers_, heads_;
  double tau_;
  std::int64_t first_pos_;
  int stride_;
  mutable std::mutex mu_;
  std::vector<double> sum_meter_;
  std::vector<std::int64_t> count_;
  std::vector<attn::MeterCell> samples_;
  std::int64_t cells_ = 0, covered_ = 0, covered_before_ = 0, overflow_ = 0, repaired_ = 0, checked_ = 0,
               violations_ = 0;
  double raw_max_ = 0.0;
};

// One JSON object per line for each cell: layer, q_head, pos, raw, raw_before, meter, v_meter,
// repaired and tv (where computed); +inf as the string "inf".
void write_cells_jsonl(std::ostream& out, std::span<const attn::MeterCell> cells);

}  // namespace witcert::gate
