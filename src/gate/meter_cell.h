// What the certified cache reports for every (layer, query head, position) it serves, and the
// sinks that receive it while the cache serves.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "gate/per_thread.h"

namespace witcert::gate {

struct MeterCell {
  int layer;
  int q_head;
  std::int64_t pos;     // the query's position; it attends over [0, pos], or its window's part of it
  double eform_raw;     // Theorem 1 unclamped: the risk score (+inf: no guarantee)
  double meter;         // the K meter: the chosen bound shape, clamped to 1
  double v_meter;       // the V meter
  double tv;            // the true TV (NaN unless check_soundness)
  double raw_before;    // the step's values before its own repair (= the served ones when not repaired)
  double meter_before;
  double v_meter_before;
  bool repaired;
  double output_bound = 0.0;  // ‖y − ŷ‖ ≤ this for the served output (2·meter·max‖v‖ + Σ p̃ ρ^v)
  // The true error the values add, ‖Σ_t p̃_t (v̂_t − v_t)‖, in the V meter's unit (per the bound on
  // max‖v_t‖ it divides by): NaN unless check_soundness.
  double v_true = NAN;
  double v_meter_sure = 0.0;  // the V meter's sure form (Σ p̃ ρ^v / max‖v‖): v_meter unless values take Tier B
};

// A checked cell (tv not NaN) whose true TV exceeds its served K meter, or whose values' true error
// exceeds its V meter, beyond the double rounding of both (relative 1e-9, absolute 1e-12): a
// soundness violation.
inline bool violates(const MeterCell& c) {
  const bool k = !(c.tv <= c.meter * (1 + 1e-9) + 1e-12);
  const bool v = !std::isnan(c.v_true) && !(c.v_true <= c.v_meter * (1 + 1e-9) + 1e-12);
  return k || v;
}

// Receives the cells of every attention call as it is served, from several threads at once.
class MeterSink {
 public:
  virtual ~MeterSink() = default;
  virtual void record(std::span<const MeterCell> cells) = 0;
};

// Keeps every cell (tests, `--meter-json`); memory grows with the request.
class CellLog final : public MeterSink {
 public:
  void record(std::span<const MeterCell> cells) override {
    std::vector<MeterCell>& mine = shards_.local();
    mine.insert(mine.end(), cells.begin(), cells.end());
  }
  // Every cell recorded, ordered by (position, layer, query head); cells of one (layer, query
  // head, position) recorded more than once keep their order.
  std::vector<MeterCell> cells() const;

 private:
  PerThread<std::vector<MeterCell>> shards_;
};

// Orders cells by (position, layer, query head), stably.
void sort_cells(std::vector<MeterCell>& cells);

}  // namespace witcert::gate
