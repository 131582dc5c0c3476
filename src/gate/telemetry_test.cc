// Telemetry aggregated in place: known answers for coverage, overflow, repairs, violations, the
// histogram quantiles, the worst cells and the sampling stride; concurrent recording; the JSON lines.
#include "gate/telemetry.h"

#include "base/alloc_counter.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
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

Telemetry::Options options(double tau, std::int64_t first_pos = 0, int stride = 0) {
  Telemetry::Options o;
  o.tau_k = tau;
  o.first_pos = first_pos;
  o.stride = stride;
  return o;
}

// The verdict of every class of request, with the counts its reason gives: no cell; every cell
// within τ with no repair; within τ after repairs at decode steps or from pages promoted at
// prefill; a cell above τ_K, or above τ_V alone, or with a non-finite meter; a soundness violation
// (at-risk even with every cell within τ).
TEST(Telemetry, VerdictForEveryClassOfRequest) {
  const auto summary = [](std::vector<MeterCell> cells, std::int64_t page_ins = 0) {
    Telemetry t(2, 2, options(0.2));
    t.record(cells);
    TelemetrySummary s = t.summary();
    s.page_ins = page_ins;
    return s;
  };
  const auto has = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  TelemetrySummary none = summary({});
  EXPECT_EQ(none.verdict(), Verdict::unmetered);
  EXPECT_TRUE(has(none.reason(), "no decode step"));
  ASSERT_EQ(none.above_tau_by_layer.size(), 2u);
  EXPECT_TRUE(std::isnan(none.above_tau_by_layer[0]));

  const std::vector<MeterCell> within = {cell(0, 0, 0, 0.1, 0.1), cell(1, 1, 0, 0.15, 0.15)};
  TelemetrySummary ok = summary(within);
  EXPECT_EQ(ok.verdict(), Verdict::certified);
  EXPECT_EQ(ok.reason(), "every one of 2 cells met tau_K 0.2 and tau_V 0.05");
  EXPECT_EQ(summary(within, /*page_ins=*/3).verdict(), Verdict::repaired);
  std::vector<MeterCell> repaired = within;
  repaired.push_back(cell(0, 1, 1, 4.0, 0.0, /*repaired=*/true));
  TelemetrySummary r = summary(repaired, 2);
  EXPECT_EQ(r.verdict(), Verdict::repaired);
  EXPECT_TRUE(has(r.reason(), "repaired 1 of them and promoted 2 pages")) << r.reason();
  EXPECT_EQ(r.saturated, 1);  // raw 4 before its repair

  std::vector<MeterCell> above = within;
  above.push_back(cell(1, 0, 2, 0.5, 0.5));
  TelemetrySummary a = summary(above);
  EXPECT_EQ(a.verdict(), Verdict::at_risk);
  EXPECT_TRUE(has(a.reason(), "1 of 3 cells (33.3 %) exceed tau_K 0.2 or tau_V 0.05")) << a.reason();
  EXPECT_TRUE(has(a.reason(), "worst: layer 1, head 0, step 2, meter 0.500")) << a.reason();
  EXPECT_TRUE(has(a.reason(), "a gate (tau_k) would repair them")) << a.reason();
  EXPECT_DOUBLE_EQ(a.above_tau_by_layer[0], 0.0);
  EXPECT_DOUBLE_EQ(a.above_tau_by_layer[1], 0.5);

  MeterCell v_only = cell(0, 0, 3, 0.01, 0.01);
  v_only.v_meter = 0.3;  // above τ_V = 0.05
  MeterCell nan_meter = cell(0, 1, 3, NAN, NAN);
  for (const MeterCell& c : {v_only, nan_meter}) {
    std::vector<MeterCell> cells = within;
    cells.push_back(c);
    const TelemetrySummary s = summary(cells);
    EXPECT_EQ(s.verdict(), Verdict::at_risk) << c.v_meter << " " << c.meter;
    EXPECT_DOUBLE_EQ(s.above_tau_by_layer[0], 0.5);
  }
  EXPECT_EQ(summary({nan_meter}).saturated, 1);

  std::vector<MeterCell> unsound = within;
  unsound.push_back(cell(0, 0, 4, 0.05, 0.05, false, /*tv=*/0.1));
  TelemetrySummary u = summary(unsound);
  EXPECT_EQ(u.verdict(), Verdict::at_risk);
  EXPECT_TRUE(has(u.reason(), "soundness check found 1 of 1 checked cells")) << u.reason();

  const nlohmann::json j = a.to_json();
  EXPECT_EQ(j.at("verdict"), "at-risk");
  EXPECT_EQ(j.at("reason"), a.reason());
  EXPECT_EQ(j.at("above_tau_by_layer"), nlohmann::json::parse("[0.0, 0.5]"));
  EXPECT_EQ(none.to_json().at("above_tau_by_layer"), nlohmann::json::parse("[null, null]"));
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
  // The quantiles count every cell, 0, 0.01, …, 0.99: the median is index 50, 0.5, read as the
  // upper edge of its bucket.
  EXPECT_GE(s.raw_p50, 0.5);
  EXPECT_LE(s.raw_p50, 0.5 * std::pow(10.0, 1.0 / LogHistogram::kPerDecade));
  EXPECT_DOUBLE_EQ(s.raw_max, 0.99);
  EXPECT_EQ(t.raw_histogram().counts.back(), 0);
  std::int64_t counted = 0;
  for (std::int64_t n : t.raw_histogram().counts) counted += n;
  EXPECT_EQ(counted, 100);  // every cell, not only the samples
}

TEST(Telemetry, KeepsNoCellsUnlessAStrideIsAskedFor) {
  Telemetry t(2, 3, options(0.2, /*first_pos=*/4));
  for (int step = 0; step < 1000; ++step)
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 3; ++h) {
        const MeterCell c = cell(l, h, 4 + step, 0.1, 0.1);
        t.record({&c, 1});
      }
  EXPECT_TRUE(t.samples().empty());
  EXPECT_EQ(t.summary().cells, 6000);
  EXPECT_THROW(Telemetry(1, 1, options(0.2, 0, -1)), std::invalid_argument);
}

// A request's telemetry does not grow with its length: once a thread's shard exists, recording
// allocates nothing, however many cells arrive (overflowing and non-finite ones included).
TEST(Telemetry, RecordingAllocatesNothingOnceWarm) {
  Telemetry t(3, 4, options(0.2, /*first_pos=*/10));
  std::vector<MeterCell> step;
  for (int l = 0; l < 3; ++l)
    for (int h = 0; h < 4; ++h) step.push_back(cell(l, h, 10, 0.1 * (l + h), 0.1, h == 3, l == 1 ? 0.01 : NAN));
  t.record(step);  // makes this thread's shard
  const long before = testing_util::thread_allocations();
  for (int pos = 11; pos < 5000; ++pos) {
    for (MeterCell& c : step) {
      c.pos = pos;
      c.raw_before = pos % 97 == 0 ? INFINITY : (pos % 89 == 0 ? NAN : 1e-6 * pos * (c.q_head + 1));
    }
    t.record(step);
  }
  EXPECT_EQ(testing_util::thread_allocations(), before);
  EXPECT_EQ(t.summary().cells, 12 * 4990);
}

TEST(LogHistogram, BucketsAndEdgesWithKnownAnswers) {
  EXPECT_EQ(LogHistogram::bucket_of(0.0), 0);
  EXPECT_EQ(LogHistogram::bucket_of(-1.0), 0);
  EXPECT_EQ(LogHistogram::bucket_of(1e-300), 1);
  EXPECT_EQ(LogHistogram::bucket_of(LogHistogram::kLow), 1);
  EXPECT_EQ(LogHistogram::bucket_of(LogHistogram::kHigh), LogHistogram::kBuckets - 2);
  EXPECT_EQ(LogHistogram::bucket_of(LogHistogram::kHigh * 1.000001), LogHistogram::kBuckets - 1);
  EXPECT_EQ(LogHistogram::bucket_of(INFINITY), LogHistogram::kBuckets - 1);
  EXPECT_EQ(LogHistogram::bucket_of(NAN), LogHistogram::kBuckets - 1);
  EXPECT_DOUBLE_EQ(LogHistogram::upper_edge(0), 0.0);
  EXPECT_TRUE(std::isinf(LogHistogram::upper_edge(LogHistogram::kBuckets - 1)));
  // Every value lies in (edge(b − 1), edge(b)] of its bucket, at the edges themselves too.
  for (int b = 2; b < LogHistogram::kBuckets - 1; ++b) {
    const double lo = LogHistogram::upper_edge(b - 1), hi = LogHistogram::upper_edge(b);
    ASSERT_LT(lo, hi);
    EXPECT_EQ(LogHistogram::bucket_of(hi), b);
    EXPECT_EQ(LogHistogram::bucket_of(std::nextafter(lo, INFINITY)), b);
    EXPECT_EQ(LogHistogram::bucket_of(std::sqrt(lo * hi)), b);
  }
  LogHistogram h;
  EXPECT_TRUE(std::isnan(h.quantile(0.5)));
  for (int i = 0; i < 3; ++i) h.add(0.0);
  h.add(INFINITY);
  EXPECT_EQ(h.quantile(0.5), 0.0);  // ranks 0..2 are zeros
  EXPECT_TRUE(std::isinf(h.quantile(1.0)));
}

// Against the exact quantile of the same scores: never below it, at most one bucket above it, and
// never above the largest score, over spread, clustered, zero-heavy and overflowing samples.
TEST(LogHistogram, QuantilesBoundTheExactOnesWithinOneBucket) {
  std::mt19937_64 rng(7);
  const double bucket = std::pow(10.0, 1.0 / LogHistogram::kPerDecade);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<double> v;
    const int n = 1 + static_cast<int>(rng() % 3000);
    std::uniform_real_distribution<double> exponent(-14.0, 12.0), unit(0.0, 1.0);
    for (int i = 0; i < n; ++i) {
      const double u = unit(rng);
      if (trial % 4 == 1 && u < 0.3) v.push_back(0.0);
      else if (trial % 4 == 2 && u < 0.05) v.push_back(INFINITY);
      else if (trial % 4 == 3) v.push_back(0.2 + 1e-3 * u);
      else v.push_back(std::pow(10.0, exponent(rng)));
    }
    LogHistogram h, left, right;
    for (std::size_t i = 0; i < v.size(); ++i) (i % 2 ? left : right).add(v[i]), h.add(v[i]);
    left.merge(right);
    std::vector<double> sorted = v;
    std::sort(sorted.begin(), sorted.end());
    for (double q : {0.0, 0.1, 0.5, 0.9, 0.99, 1.0}) {
      const std::size_t rank = std::min(sorted.size() - 1, static_cast<std::size_t>(q * sorted.size()));
      const double exact = sorted[rank], got = h.quantile(q);
      EXPECT_EQ(got, left.quantile(q)) << "merged shards read as one";
      EXPECT_GE(got, exact) << trial << " q " << q;
      EXPECT_LE(got, sorted.back());
      if (exact <= LogHistogram::kLow) {
        EXPECT_LE(got, std::max(exact, LogHistogram::kLow));
      } else if (exact <= LogHistogram::kHigh) {
        EXPECT_LE(got, exact * bucket * (1 + 1e-12)) << trial << " q " << q;
      }
    }
  }
}

// The worst cells are the largest raw scores before repair whichever thread served them, ties to
// the earlier (position, layer, head); their step counts from the first decode position.
TEST(Telemetry, WorstCellsAreTheLargestRawScoresIndependentOfThreads) {
  Telemetry t(4, 2, options(0.2, /*first_pos=*/100));
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&t, w] {
      for (int i = 0; i < 500; ++i) {
        const double raw = (i == 250 + w) ? 10.0 + w : (i == 7 ? 50.0 : 0.01 * (i % 10));
        const MeterCell c[2] = {cell(w, 0, 100 + i, raw, std::min(1.0, raw)), cell(w, 1, 100 + i, 0.0, 0.0)};
        t.record(c);
      }
    });
  for (std::thread& th : threads) th.join();
  const TelemetrySummary s = t.summary();
  ASSERT_EQ(s.worst.size(), static_cast<std::size_t>(kWorstCells));
  // Four cells of 50 at step 7 (layers 0..3 in order), then the 13 of layer 3 at step 253.
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(s.worst[l].raw_before, 50.0);
    EXPECT_EQ(s.worst[l].layer, l);
    EXPECT_EQ(s.worst[l].pos, 107);
  }
  EXPECT_EQ(s.worst[4].raw_before, 13.0);
  EXPECT_EQ(s.worst[4].layer, 3);
  const nlohmann::json j = s.to_json();
  ASSERT_EQ(j["worst"].size(), static_cast<std::size_t>(kWorstCells));
  EXPECT_EQ(j["worst"][4]["step"], 253);
  EXPECT_EQ(j["worst"][0]["q_head"], 0);
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
  EXPECT_THROW(Telemetry(1, 1, options(0.2, 0, -1)), std::invalid_argument);
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
