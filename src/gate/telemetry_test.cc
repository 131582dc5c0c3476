// Telemetry aggregated in place: known answers for coverage, overflow, repairs, violations, the
// sampling stride and the quantiles; concurrent recording; the JSON lines.
#include "gate/telemetry.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace witcert::gate {
namespace {

// A cell whose V meter is 0 and whose values before repair are `raw` (the K meter before repair
// is min(1, raw), the e-form).
MeterCell cell(int layer, int head, std::int64_t pos, double raw, double meter, bool repaired = false,
                     double tv = NAN) {
  return {layer, head, pos, raw, meter, 0.0, tv, raw, std::min(1.0, raw), 0.0, repaired};
}

Telemetry::Options options(double tau, std::int64_t first_pos = 0, int stride = 1) {
  Telemetry::Options o;
  o.tau_k = tau;
  o.first_pos = first_pos;
  o.stride = stride;
  return o;
}

TEST(Telemetry, CountsDecodeStepsOnlyWithKnownAnswers) {
  Telemetry t(2, 2, options(0.2, /*first_pos=*/10));
  std::vector<MeterCell> cells = {
      cell(0, 0, 9, 5.0, 1.0),                 // prompt: not counted
      cell(0, 0, 10, 0.1, 0.1),                // covered
      cell(0, 1, 10, 0.3, 0.3),                // not covered
      cell(1, 0, 11, INFINITY, 0.15, true),    // overflow before repair, served 0.15 after
      cell(1, 1, 12, 0.05, 0.05, false, 0.2),  // a violation: tv 0.2 > meter 0.05
  };
  t.record(cells);
  const TelemetrySummary s = t.summary();
  EXPECT_EQ(s.cells, 4);
  EXPECT_DOUBLE_EQ(s.coverage.k, 3.0 / 4);         // 0.1, 0.15, 0.05
  EXPECT_DOUBLE_EQ(s.coverage.joint, 3.0 / 4);     // every V meter is 0
  EXPECT_DOUBLE_EQ(s.coverage.v, 1.0);
  EXPECT_DOUBLE_EQ(s.coverage.eform, 2.0 / 4);     // the served raw scores 0.1, 0.05 (0.3 and inf → 1 fail)
  EXPECT_DOUBLE_EQ(s.coverage_before.k, 2.0 / 4);  // 0.1, 0.05 (inf clamps to 1)
  EXPECT_EQ(s.overflow, 1);
  EXPECT_EQ(s.repaired, 1);
  EXPECT_EQ(s.checked, 1);
  EXPECT_EQ(s.violations, 1);
  EXPECT_TRUE(std::isinf(s.raw_max));
  const std::vector<double> h = t.heatmap();
  ASSERT_EQ(h.size(), 4u);
  EXPECT_DOUBLE_EQ(h[0], 0.1);
  EXPECT_DOUBLE_EQ(h[1], 0.3);
  EXPECT_DOUBLE_EQ(h[2], 0.15);
  EXPECT_DOUBLE_EQ(h[3], 0.05);
}

// Joint coverage needs both sides to pass; K, V and e-form coverage are counted apart, as served
// and before the step's repair.
TEST(Telemetry, JointKAndVCoverageWithKnownAnswers) {
  Telemetry::Options o = options(0.2);
  o.tau_v = 0.05;
  Telemetry t(1, 4, o);
  // layer, head, pos, raw, meter, v_meter, tv, raw_before, meter_before, v_meter_before, repaired
  const std::vector<MeterCell> cells = {
      {0, 0, 0, 0.1, 0.1, 0.01, NAN, 0.1, 0.1, 0.01, false},  // both pass
      {0, 1, 0, 0.1, 0.1, 0.20, NAN, 0.1, 0.1, 0.20, false},  // V fails: not joint
      {0, 2, 0, 0.5, 0.15, 0.0, NAN, 0.5, 0.15, 0.0, false},  // K passes on the min shape, not on the e-form
      {0, 3, 0, 0.0, 0.0, 0.0, NAN, 9.0, 1.0, 0.30, true},    // repaired: fails both before, passes after
  };
  t.record(cells);
  const TelemetrySummary s = t.summary();
  EXPECT_DOUBLE_EQ(s.coverage.joint, 3.0 / 4);
  EXPECT_DOUBLE_EQ(s.coverage.k, 1.0);
  EXPECT_DOUBLE_EQ(s.coverage.v, 3.0 / 4);
  EXPECT_DOUBLE_EQ(s.coverage.eform, 3.0 / 4);
  EXPECT_DOUBLE_EQ(s.coverage_before.joint, 2.0 / 4);
  EXPECT_DOUBLE_EQ(s.coverage_before.k, 3.0 / 4);
  EXPECT_DOUBLE_EQ(s.coverage_before.v, 2.0 / 4);
  EXPECT_DOUBLE_EQ(s.coverage_before.eform, 2.0 / 4);
  const nlohmann::json j = s.to_json();
  EXPECT_EQ(j["bound"], "min");
  EXPECT_EQ(j["bound_label"], "min of sound forms");
  EXPECT_DOUBLE_EQ(j["coverage"]["eform"].get<double>(), 3.0 / 4);
  EXPECT_DOUBLE_EQ(j["coverage_before_gate"]["joint"].get<double>(), 2.0 / 4);
}

TEST(Telemetry, StrideKeepsEveryNthStepForQuantilesAndCountsAll) {
  Telemetry t(1, 1, options(0.5, /*first_pos=*/100, /*stride=*/4));
  for (int step = 0; step < 100; ++step) {
    const MeterCell c = cell(0, 0, 100 + step, step / 100.0, std::min(1.0, step / 100.0));
    t.record({&c, 1});
  }
  const TelemetrySummary s = t.summary();
  EXPECT_EQ(s.cells, 100);
  EXPECT_DOUBLE_EQ(s.coverage.joint, 51.0 / 100);  // steps 0..50
  const std::vector<MeterCell> kept = t.samples();
  ASSERT_EQ(kept.size(), 25u);
  for (std::size_t i = 0; i < kept.size(); ++i) EXPECT_EQ(kept[i].pos, 100 + 4 * static_cast<std::int64_t>(i));
  // Samples are 0, 0.04, …, 0.96: the median is the 13th (index 12), 0.48.
  EXPECT_DOUBLE_EQ(s.raw_p50, 0.48);
  EXPECT_DOUBLE_EQ(s.raw_max, 0.99);  // from every cell, not only the samples
}

TEST(Telemetry, ConcurrentRecordingLosesNothing) {
  Telemetry t(4, 3, options(0.2));
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&t, w] {
      for (int i = 0; i < 5000; ++i) {
        const MeterCell c[3] = {cell(w, 0, i, 0.1, 0.1), cell(w, 1, i, 0.3, 0.3), cell(w, 2, i, 0.1, 0.1)};
        t.record(c);
      }
    });
  for (std::thread& th : threads) th.join();
  const TelemetrySummary s = t.summary();
  EXPECT_EQ(s.cells, 4 * 5000 * 3);
  EXPECT_DOUBLE_EQ(s.coverage.joint, 2.0 / 3);
}

TEST(Telemetry, ShardsOfManyThreadsAndTelemetriesMergeIntoTheirOwnTotals) {
  // Each thread alternates between two telemetries and a cell log: every cell lands in the
  // instance it was recorded into, the heatmap is the mean per (layer, head), and the log's cells
  // come out ordered by (position, layer, head).
  Telemetry a(4, 2, options(0.2)), b(4, 2, options(0.2));
  CellLog log;
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (int i = 0; i < 2000; ++i) {
        const MeterCell c[2] = {cell(w, 0, i, 0.1, 0.1), cell(w, 1, i, 0.5, 0.5)};
        a.record(c);
        b.record({c, 1});
        log.record(c);
      }
    });
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(a.summary().cells, 4 * 2000 * 2);
  EXPECT_EQ(b.summary().cells, 4 * 2000);
  EXPECT_DOUBLE_EQ(a.summary().coverage.k, 0.5);
  EXPECT_DOUBLE_EQ(b.summary().coverage.k, 1.0);
  const std::vector<double> heat = a.heatmap(), heat_b = b.heatmap();
  for (int l = 0; l < 4; ++l) {
    EXPECT_NEAR(heat[l * 2], 0.1, 1e-12);
    EXPECT_NEAR(heat[l * 2 + 1], 0.5, 1e-12);
    EXPECT_TRUE(std::isnan(heat_b[l * 2 + 1]));
  }
  const std::vector<MeterCell> cells = log.cells();
  ASSERT_EQ(cells.size(), 4u * 2000 * 2);
  for (std::size_t i = 0; i < cells.size(); ++i) {
    EXPECT_EQ(cells[i].pos, static_cast<std::int64_t>(i / 8));
    EXPECT_EQ(cells[i].layer, static_cast<int>(i / 2 % 4));
    EXPECT_EQ(cells[i].q_head, static_cast<int>(i % 2));
  }
}

TEST(Telemetry, RejectsImpossibleArgumentsAndForeignCells) {
  EXPECT_THROW(Telemetry(0, 1, options(0.2)), std::invalid_argument);
  EXPECT_THROW(Telemetry(1, 1, options(0.0)), std::invalid_argument);
  EXPECT_THROW(Telemetry(1, 1, options(NAN)), std::invalid_argument);
  EXPECT_THROW(Telemetry(1, 1, options(INFINITY)), std::invalid_argument);
  EXPECT_THROW(Telemetry(1, 1, options(0.2, 0, 0)), std::invalid_argument);
  Telemetry::Options bad_v = options(0.2);
  for (double tau_v : {0.0, -1.0, double(NAN), double(INFINITY)}) {
    bad_v.tau_v = tau_v;
    EXPECT_THROW(Telemetry(1, 1, bad_v), std::invalid_argument) << tau_v;
  }
  Telemetry t(1, 1, options(0.2));
  const MeterCell c = cell(1, 0, 0, 0.1, 0.1);
  EXPECT_THROW(t.record({&c, 1}), std::out_of_range);
}

TEST(Telemetry, WritesOneJsonLinePerCellWithInfinityAsAString) {
  std::vector<MeterCell> cells = {cell(0, 1, 5, INFINITY, 1.0, true), cell(2, 0, 6, 0.25, 0.25, false, 0.1)};
  std::ostringstream out;
  write_cells_jsonl(out, cells);
  std::istringstream in(out.str());
  std::string line;
  std::vector<nlohmann::json> lines;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["raw"], "inf");
  EXPECT_EQ(lines[0]["q_head"], 1);
  EXPECT_EQ(lines[0]["repaired"], true);
  EXPECT_FALSE(lines[0].contains("tv"));
  EXPECT_EQ(lines[1]["layer"], 2);
  EXPECT_DOUBLE_EQ(lines[1]["meter"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(lines[1]["tv"].get<double>(), 0.1);
}

}  // namespace
}  // namespace witcert::gate
