// Telemetry of the meter: per (layer, query head) aggregates, coverage at τ, raw-score quantiles,
// overflow and repair counts, written as JSON and JSON lines (rendering lives in apps/report).
#pragma once

#include <array>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cert/meter.h"
#include "gate/meter_cell.h"
#include "gate/per_thread.h"

namespace witcert::gate {

// Upper bounds of the raw-score histogram's buckets (Telemetry::raw_histogram).
inline constexpr double kRawScoreBounds[] = {0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0};

// Coverage is the fraction of cells that pass: joint (pass_K ∧ pass_V, the paper's headline),
// K alone (K meter ≤ τ_K), V alone (V meter ≤ τ_V), and the K coverage of Theorem 1's e-form
// (clamped raw score ≤ τ_K), which is what the paper's coverage figures count whatever shape the
// meter uses. "As served" is after the step's repair; "before" is the step's meters before its own
// repair (pages repaired at earlier steps stay exact).
struct Coverage {
  double joint = 0.0, k = 0.0, v = 0.0, eform = 0.0;
};

// Non-negative scores counted on log-spaced buckets, so that quantiles are read in fixed memory
// whatever the number of scores: zero, (0, kLow], kPerDecade buckets a decade up to kHigh, and
// everything above (+inf and NaN included). A quantile is its bucket's upper edge, capped at the
// largest score seen: never below the true quantile and at most one bucket (7.5 %) above it.
class LogHistogram {
 public:
  static constexpr double kLow = 1e-9, kHigh = 1e9;
  static constexpr int kPerDecade = 32, kDecades = 18;
  static constexpr int kBuckets = 2 + kPerDecade * kDecades + 1;

  void add(double x);
  void merge(const LogHistogram& o);
  std::int64_t count() const { return n_; }
  // The ⌊q·n⌋-th smallest score (0-based; the last for q = 1) rounded up as above; NaN when empty.
  double quantile(double q) const;
  // The upper edge of bucket b (0 for the zero bucket, +inf for the last).
  static double upper_edge(int b);
  static int bucket_of(double x);

 private:
  std::array<std::int64_t, kBuckets> counts_{};
  std::int64_t n_ = 0;
  double max_ = 0.0;
};

// How many worst cells (largest raw score before repair) a summary keeps.
inline constexpr int kWorstCells = 5;

// What a request's meter says, for a person: certified (every served cell met τ_K and τ_V with no
// repair), repaired (every served cell met them, some after the gate's repair or on pages it
// promoted), at-risk (some
// served cell did not, or the soundness check found a cell above its meter), unmetered (no cell:
// the exact fp16 cache, or no decode step).
enum class Verdict { certified, repaired, at_risk, unmetered };  // the C API's witcert_verdict, in order
const char* verdict_name(Verdict v);  // "certified", "repaired", "at-risk", "unmetered"

struct TelemetrySummary {
  std::int64_t cells = 0;
  cert::BoundShape bound = cert::BoundShape::min;  // the K meter's shape
  double tau_k = 0.0, tau_v = 0.0;
  Coverage coverage;         // as served
  Coverage coverage_before;  // before the step's own repair
  // Raw scores before repair: quantiles from a LogHistogram of every cell, the maximum exact.
  double raw_p50 = 0.0, raw_p90 = 0.0, raw_p99 = 0.0, raw_max = 0.0;
  double v_meter_p50 = 0.0;   // the served V meter's median, from a LogHistogram
  std::int64_t overflow = 0;  // raw = +inf
  std::vector<MeterCell> worst;  // up to kWorstCells cells, largest raw score before repair first
  std::int64_t first_pos = 0;    // a cell's decode step is its pos − first_pos
  double worst_tv_ratio = 0.0;   // the largest true TV / served meter over the checked cells
  std::int64_t repaired = 0;
  std::int64_t checked = 0, violations = 0;  // soundness against the true TV, where computed
  std::int64_t saturated = 0;  // cells whose raw score before repair was ≥ 1: a meter that says nothing
  // Pages the gate promoted for the request, prefill included (set by its runner; the cells see
  // only the repairs of decode steps).
  std::int64_t page_ins = 0;
  // Per layer, the share of its served cells above τ_K or τ_V (NaN for a layer without cells).
  std::vector<double> above_tau_by_layer;

  Verdict verdict() const;
  // One line that says why, with the counts behind it, the worst cell where one failed, and
  // what would repair it.
  std::string reason() const;
  nlohmann::json to_json() const;
};

// Aggregates the served cells of one request in place, as the cache serves them (it is the
// cache's MeterSink): counts, coverage, overflow, repairs, histograms of the raw score and the V
// meter, the worst cells and the per-(layer, head) mean meter over every decode-step cell. Only
// where a caller asks (stride ≥ 1) are the cells of every stride-th decode step also kept, for
// JSON lines. Each thread accumulates into its own shard, with no lock on the attention path; the
// readers merge the shards after the forward passes. Without samples, memory is bounded by
// threads × (layers × heads + two histograms), whatever the request's length, and recording
// allocates nothing once a thread's shard exists.
class Telemetry final : public MeterSink {
 public:
  // Cells at positions < first_pos (the prompt) are not counted; a cell's decode step is
  // pos − first_pos. Throws std::invalid_argument for no layers or heads, τ_K or τ_V not
  // positive and finite, or stride < 0.
  struct Options {
    double tau_k = 0.2, tau_v = 0.05;
    cert::BoundShape bound = cert::BoundShape::min;  // the shape the cells' K meter uses
    std::int64_t first_pos = 0;
    int stride = 0;  // keep the cells of every stride-th decode step; 0 keeps none
  };
  Telemetry(int layers, int heads, const Options& opts);

  // Called by the cache with the cells of each attention call, from several threads at once.
  void record(std::span<const MeterCell> cells) override;

  // The readers: call them between forward passes, not during one.
  TelemetrySummary summary() const;
  // The sampled cells, ordered by (position, layer, query head); empty when stride is 0.
  std::vector<MeterCell> samples() const;
  // Mean served meter per (layer, head), row-major [layer][head] (NaN where no cell was seen).
  std::vector<double> heatmap() const;
  // Every cell's raw score before repair, counted per bucket of kRawScoreBounds (a score ≤ the
  // bound and above the one before; the last count is everything above, +inf included), and the
  // sum of the finite ones.
  struct RawHistogram {
    std::vector<std::int64_t> counts;
    double finite_sum = 0.0;
  };
  RawHistogram raw_histogram() const;
  int layers() const { return layers_; }
  int heads() const { return heads_; }

 private:
  struct Covered {
    std::int64_t joint = 0, k = 0, v = 0, eform = 0;
    void add(double meter, double v_meter, double eform_raw, double tau_k, double tau_v);
    void merge(const Covered& o);
    Coverage over(std::int64_t cells) const;
  };
  struct Shard {
    std::vector<double> sum_meter;     // [layer][head]
    std::vector<std::int64_t> count;   // [layer][head]
    std::vector<MeterCell> samples;    // only when stride ≥ 1
    Covered covered, covered_before;
    std::vector<std::int64_t> above_tau;  // [layer]: served cells above τ_K or τ_V
    std::int64_t cells = 0, overflow = 0, repaired = 0, checked = 0, violations = 0, saturated = 0;
    double raw_max = 0.0, worst_tv_ratio = 0.0;
    LogHistogram raw, v_meter;
    std::array<std::int64_t, std::size(kRawScoreBounds) + 1> raw_buckets{};
    double raw_finite_sum = 0.0;
    std::array<MeterCell, kWorstCells> worst{};
    int n_worst = 0;
    void keep_if_worst(const MeterCell& c);
  };
  int layers_, heads_;
  Options opts_;
  PerThread<Shard> shards_;
};

// One JSON object per line for each cell: layer, q_head, pos, raw, meter, v_meter, their values
// before the step's repair (raw_before, meter_before, v_meter_before), repaired and tv (where
// computed); +inf as the string "inf".
void write_cells_jsonl(std::ostream& out, std::span<const MeterCell> cells);

}  // namespace witcert::gate
