// Telemetry of the meter (DESIGN §2, layer 6): per (layer, query head) aggregates, coverage at
// τ, raw-score quantiles, overflow and repair counts, written as JSON and as a heatmap image.
#pragma once

#include <cstdint>
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

class Telemetry {
 public:
  // stride ≥ 1 keeps every stride-th cell of each (layer, head) for the quantiles (all are counted).
  Telemetry(int layers, int heads, double tau, int stride = 1);

  // Adds the cells at positions ≥ first_pos (the decode steps of a request).
  void add(std::span<const attn::MeterCell> cells, std::int64_t first_pos);

  TelemetrySummary summary() const;
  // Mean served meter per (layer, head), row-major [layer][head].
  std::vector<double> heatmap() const;
  // An SVG heatmap: layers down, heads across, colour = mean meter in [0, 1].
  std::string heatmap_svg(const std::string& title) const;

 private:
  int layers_, heads_;
  double tau_;
  int stride_;
  std::vector<double> sum_meter_;
  std::vector<std::int64_t> count_, seen_;
  std::vector<double> raw_samples_;
  std::int64_t cells_ = 0, covered_ = 0, covered_before_ = 0, overflow_ = 0, repaired_ = 0, checked_ = 0,
               violations_ = 0;
  double raw_max_ = 0.0;
};

}  // namespace witcert::gate
