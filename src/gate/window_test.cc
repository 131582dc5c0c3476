// Sliding-window attention (Gemma 3's local layers): a query at position p attends only to
// [window_begin(p, W), p]. Checked on every format, dither mode and page size, for a run of prefill
// positions (attend_causal) and for one position (attend over [begin, end)):
// - each output is within the cell's own output bound of the exact attention over the window,
//   computed here from the fp16 keys and values — the positions before the window carry values a
//   hundred times larger, so a cache that read them would miss by far;
// - every cell is sound against the true TV, and the run gives each position its own attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "base/fp16.h"
#include "formats/kv_format.h"
#include "gate/certified_cache.h"
#include "gate/test_log.h"
#include "kvcache/test_config.h"

namespace witcert::gate {
namespace {

using kvcache::window_begin;

constexpr int kGroup = 2, kDim = 32, kN = 72;
constexpr std::int64_t kRow = kGroup * kDim;

struct Data {
  std::vector<float> k, v, q;
};

// Keys with one large channel pair; values of the first half of the sequence 100× the rest.
Data data(unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  Data d;
  for (int t = 0; t < kN; ++t)
    for (int i = 0; i < kDim; ++i) {
      d.k.push_back(g(rng) * (i == 4 || i == 5 ? 8.0f : 1.0f));
      d.v.push_back(g(rng) * (t < kN / 2 ? 100.0f : 1.0f));
    }
  for (int i = 0; i < kN * kRow; ++i) d.q.push_back(g(rng));
  return d;
}

// Exact attention in double of one query over [begin, end) of the fp16-rounded keys and values.
std::vector<double> exact_window(const Data& d, const float* q, std::int64_t begin, std::int64_t end) {
  const auto r = [](float x) { return static_cast<double>(fp16_to_float(fp16_from_float(x))); };
  std::vector<double> z;
  for (std::int64_t t = begin; t < end; ++t) {
    double s = 0.0;
    for (int i = 0; i < kDim; ++i) s += double(q[i]) * r(d.k[t * kDim + i]);
    z.push_back(s / std::sqrt(double(kDim)));
  }
  const double m = *std::max_element(z.begin(), z.end());
  double l = 0.0;
  for (double& x : z) l += x = std::exp(x - m);
  std::vector<double> y(kDim, 0.0);
  for (std::int64_t t = begin; t < end; ++t)
    for (int i = 0; i < kDim; ++i) y[i] += z[t - begin] / l * r(d.v[t * kDim + i]);
  return y;
}

double distance(const float* a, const std::vector<double>& b) {
  double s = 0.0;
  for (int i = 0; i < kDim; ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

struct QueryRun {
  int pos0, n;
};
// Runs that start inside the first window, straddle it, lie past it, and a single position.
const std::vector<QueryRun> kRuns = {{0, 24}, {24, 16}, {40, 1}, {41, 31}};

// Every served cell of `log` for the run is sound, and its output is within its output bound of
// the exact attention over the window.
void expect_windowed(const Data& d, const std::vector<float>& out, const QueryRun& run, std::int64_t window,
                     const std::vector<MeterCell>& cells) {
  ASSERT_EQ(cells.size(), static_cast<std::size_t>(run.n * kGroup));
  for (const MeterCell& c : cells) {
    const std::int64_t i = c.pos - run.pos0;
    ASSERT_TRUE(i >= 0 && i < run.n) << c.pos;
    ASSERT_FALSE(violates(c)) << "pos " << c.pos << " tv " << c.tv << " meter " << c.meter;
    const float* q = &d.q[c.pos * kRow + c.q_head * kDim];
    const std::vector<double> want = exact_window(d, q, window_begin(c.pos, window), c.pos + 1);
    const double scale = std::sqrt(std::inner_product(want.begin(), want.end(), want.begin(), 0.0));
    ASSERT_LE(distance(&out[i * kRow + c.q_head * kDim], want), c.output_bound * (1 + 1e-6) + 1e-4 * (1 + scale))
        << "pos " << c.pos << " head " << c.q_head << " window " << window;
  }
}

TEST(SlidingWindow, EveryFormatModeAndPageAttendsOnlyItsWindow) {
  long cells = 0;
  for (const std::string& fmt : formats::kv_format_names()) {
    if (fmt == formats::kFp16) continue;  // the exact cache's own test below
    std::vector<kvcache::DitherMode> modes = {kvcache::DitherMode::per_slot};
    if (kvcache::dithered(fmt))
      modes = {kvcache::DitherMode::per_slot, kvcache::DitherMode::shared_page, kvcache::DitherMode::shared_prompt,
               kvcache::DitherMode::none};
    for (kvcache::DitherMode mode : modes)
      for (int page : {1, 5, 16})
        for (std::int64_t window : {1, 7, 16, 40})
          for (const QueryRun& run : kRuns) {
            SCOPED_TRACE(fmt + " " + kvcache::dither_mode_name(mode) + " page " + std::to_string(page) + " window " +
                         std::to_string(window) + " run " + std::to_string(run.pos0) + "+" + std::to_string(run.n));
            const Data d = data(static_cast<unsigned>(page * 31 + window));
            kvcache::CacheConfig cfg = kvcache::test_config(1, 1, kDim, kN, page, fmt, fmt, 3);
            cfg.dither = mode;
            CertifiedOptions o;
            o.q_heads = kGroup;
            o.check_soundness = true;
            CellLog run_log, single_log;
            CertifiedKvCache batch(cfg, logged(o, run_log)), single(cfg, logged(o, single_log));
            batch.set_prompt_length(kN / 2);
            single.set_prompt_length(kN / 2);
            for (int t = 0; t < run.pos0 + run.n; ++t) {
              batch.write(0, 0, t, &d.k[t * kDim], &d.v[t * kDim]);
              single.write(0, 0, t, &d.k[t * kDim], &d.v[t * kDim]);
            }
            std::vector<float> got(run.n * kRow), want(run.n * kRow);
            batch.attend_causal(0, 0, &d.q[run.pos0 * kRow], kRow, kGroup, run.pos0, run.n, window, got.data(), kRow);
            for (int i = 0; i < run.n; ++i) {
              const std::int64_t p = run.pos0 + i;
              single.attend(0, 0, &d.q[p * kRow], kGroup, window_begin(p, window), p + 1, &want[i * kRow]);
            }
            expect_windowed(d, got, run, window, run_log.cells());
            expect_windowed(d, want, run, window, single_log.cells());
            // The run gives each position its own attention: the same output up to the order of
            // the merges, and a meter at least the single call's up to rounding (its union bound
            // runs over the run's widest span; the float path of shared-page dither rounds its
            // allowance per tile, and the run cuts tiles elsewhere).
            for (std::size_t i = 0; i < got.size(); ++i)
              ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << "at " << i;
            const std::vector<MeterCell> a = run_log.cells(), b = single_log.cells();
            for (std::size_t j = 0; j < a.size(); ++j) {
              ASSERT_EQ(a[j].pos, b[j].pos);
              ASSERT_GE(a[j].eform_raw, b[j].eform_raw * (1 - 1e-3) - 1e-12) << "cell " << j;
            }
            cells += static_cast<long>(a.size() + b.size());
          }
  }
  std::printf("[window] %ld windowed cells checked against the exact window\n", cells);
}

// The gate repairs within the window: every cell within τ, sound and within its output bound.
TEST(SlidingWindow, GatedRunsServeEveryWindowedPositionWithinTau) {
  for (const std::string fmt : {"q4_0", "kivi-2bit", "dither-int8"})
    for (Granularity gran : {Granularity::block, Granularity::head, Granularity::request})
      for (std::int64_t window : {7, 16}) {
        SCOPED_TRACE(fmt + " window " + std::to_string(window) + " granularity " + std::to_string(int(gran)));
        const Data d = data(5);
        CertifiedOptions o;
        o.q_heads = kGroup;
        o.check_soundness = true;
        const double tau = fmt == "dither-int8" ? 0.002 : 0.05;  // low enough that each format repairs
        o.gate = Policy::from_tau_k(tau, gran);
        CellLog log;
        CertifiedKvCache cache(kvcache::test_config(1, 1, kDim, kN, 8, fmt, fmt, 3), logged(o, log));
        for (int t = 0; t < kN; ++t) cache.write(0, 0, t, &d.k[t * kDim], &d.v[t * kDim]);
        std::vector<float> out(kN * kRow);
        for (int pos0 = 0; pos0 < kN; pos0 += 24)
          cache.attend_causal(0, 0, &d.q[pos0 * kRow], kRow, kGroup, pos0, std::min(24, kN - pos0), window,
                              &out[pos0 * kRow], kRow);
        expect_windowed(d, out, {0, kN}, window, log.cells());
        int repaired = 0;
        for (const MeterCell& c : log.cells()) {
          ASSERT_LE(c.meter, tau) << "pos " << c.pos;
          repaired += c.repaired;
        }
        std::printf("[window] %s granularity %d window %ld: %d of %d cells repaired\n", fmt.c_str(), int(gran),
                    static_cast<long>(window), repaired, kN * kGroup);
        EXPECT_GT(repaired, 0);
      }
}

// The exact cache: a windowed run is bit for bit each position's own attend over its window, and
// that is the exact attention over the window's rows.
TEST(SlidingWindow, ExactCacheRunsAreEachPositionsOwnWindowBitForBit) {
  const Data d = data(9);
  for (int page : {1, 5, 16})
    for (std::int64_t window : {1, 7, 16, 40, 100})
      for (const QueryRun& run : kRuns) {
        attention::ExactKvCache cache({1, 1, kDim, kN}, page);
        for (int t = 0; t < run.pos0 + run.n; ++t) cache.write(0, 0, t, &d.k[t * kDim], &d.v[t * kDim]);
        std::vector<float> got(run.n * kRow), want(run.n * kRow);
        cache.attend_causal(0, 0, &d.q[run.pos0 * kRow], kRow, kGroup, run.pos0, run.n, window, got.data(), kRow);
        for (int i = 0; i < run.n; ++i) {
          const std::int64_t p = run.pos0 + i;
          cache.attend(0, 0, &d.q[p * kRow], kGroup, window_begin(p, window), p + 1, &want[i * kRow]);
          for (int h = 0; h < kGroup; ++h) {
            const std::vector<double> exact = exact_window(d, &d.q[p * kRow + h * kDim], window_begin(p, window), p + 1);
            const double scale = std::sqrt(std::inner_product(exact.begin(), exact.end(), exact.begin(), 0.0));
            ASSERT_LE(distance(&want[i * kRow + h * kDim], exact), 1e-5 * (1 + scale)) << "pos " << p;
          }
        }
        ASSERT_EQ(got, want) << "page " << page << " window " << window << " run " << run.pos0;
      }
}

// A cache whose windowed layer retires its pages between passes serves, bit for bit, what a cache
// that keeps every page serves: the same outputs and the same cells (meters, true TV, repairs), on
// a windowed layer beside a global one, for every format, dither mode and page size, ungated and
// gated at every granularity; its page-ins are never more (a retired page is not paged in) and
// its windowed layer holds no more pages than its window and the current pass span.
TEST(SlidingWindow, RetiredPagesChangeNothingServed) {
  constexpr std::int64_t kW = 7;
  const std::vector<std::int64_t> passes = {0, 24, 40, 41, 42, 60, 61, kN};
  const Data d = data(13);
  long cells = 0;
  struct Arm {
    std::string fmt;
    kvcache::DitherMode mode;
    bool gated;
    Granularity gran;
    bool channel_scales = false;  // keys with channel scales over blocks of 16 tokens
  };
  std::vector<Arm> arms;
  for (const std::string& fmt : formats::kv_format_names()) {
    if (fmt == formats::kFp16) continue;
    arms.push_back({fmt, kvcache::DitherMode::per_slot, false, Granularity::block});
    if (kvcache::dithered(fmt))
      for (auto mode : {kvcache::DitherMode::shared_page, kvcache::DitherMode::shared_prompt, kvcache::DitherMode::none})
        arms.push_back({fmt, mode, false, Granularity::block});
    if (kvcache::dithered(fmt))
      for (auto mode : {kvcache::DitherMode::per_slot, kvcache::DitherMode::shared_prompt})
        arms.push_back({fmt, mode, false, Granularity::block, true});
  }
  for (const std::string fmt : {"q4_0", "kivi-2bit", "dither-int8", "dither-int4"})
    for (Granularity gran : {Granularity::block, Granularity::head, Granularity::request})
      arms.push_back({fmt, kvcache::DitherMode::per_slot, true, gran});
  for (Granularity gran : {Granularity::block, Granularity::head, Granularity::request})
    arms.push_back({"dither-int6", kvcache::DitherMode::per_slot, true, gran, true});
  for (const Arm& arm : arms)
    for (int page : {1, 5, 16}) {
      SCOPED_TRACE(arm.fmt + " " + kvcache::dither_mode_name(arm.mode) + " page " + std::to_string(page) +
                   (arm.gated ? " gated " + std::to_string(int(arm.gran)) : "") +
                   (arm.channel_scales ? " channel scales" : ""));
      kvcache::CacheConfig keep_cfg = kvcache::test_config(2, 1, kDim, kN, page, arm.fmt, arm.fmt, 3);
      keep_cfg.dither = arm.mode;
      if (arm.channel_scales) keep_cfg.key_scales = formats::ScaleGranularity::channel, keep_cfg.scale_block = 16;
      kvcache::CacheConfig cfg = keep_cfg;
      cfg.windows = {kW, 0};
      CertifiedOptions o;
      o.q_heads = kGroup;
      o.check_soundness = true;
      if (arm.gated) o.gate = Policy::from_tau_k(kvcache::dithered(arm.fmt) ? 0.002 : 0.05, arm.gran);
      CellLog keep_log, log;
      CertifiedKvCache keeps(keep_cfg, logged(o, keep_log)), retires(cfg, logged(o, log));
      keeps.set_prompt_length(40);
      retires.set_prompt_length(40);
      for (std::size_t i = 0; i + 1 < passes.size(); ++i) {
        const std::int64_t b = passes[i], n = passes[i + 1] - b;
        retires.retire_before(b);
        for (int l = 0; l < 2; ++l) {
          for (std::int64_t t = b; t < b + n; ++t) {
            keeps.write(l, 0, t, &d.k[t * kDim], &d.v[t * kDim]);
            retires.write(l, 0, t, &d.k[t * kDim], &d.v[t * kDim]);
          }
          std::vector<float> want(n * kRow), got(n * kRow);
          const std::int64_t window = l == 0 ? kW : 0;
          keeps.attend_causal(l, 0, &d.q[b * kRow], kRow, kGroup, b, n, window, want.data(), kRow);
          retires.attend_causal(l, 0, &d.q[b * kRow], kRow, kGroup, b, n, window, got.data(), kRow);
          ASSERT_EQ(got, want) << "layer " << l << " pass " << b;
        }
        // The window's pages and the pass's, and a group scheme's block still filling.
        const formats::KvScheme* scheme = cfg.k_format.scheme(formats::KvSide::key);
        const std::int64_t T = scheme ? scheme->tokens_per_block() : 1;
        // Channel scales: blocks [0, 16), [16, 32), [32, 40) in the prompt of 40, then [40, 56), …;
        // a block still filling keeps its pages.
        std::int64_t unfinished = b;
        if (arm.channel_scales && b > 0) {
          const std::int64_t first = b - 1 < 40 ? (b - 1) / 16 * 16 : 40 + (b - 41) / 16 * 16;
          const std::int64_t end = b - 1 < 40 ? std::min<std::int64_t>(first + 16, 40) : first + 16;
          unfinished = end == b ? b : first;
        }
        const std::int64_t kept = std::min({window_begin(b, kW), b / T * T, unfinished}) / page;
        EXPECT_EQ(retires.store().sequence().window_pages(), (b + n + page - 1) / page - kept) << "pass " << b;
      }
      const std::vector<MeterCell> a = keep_log.cells(), c = log.cells();
      ASSERT_EQ(a.size(), c.size());
      for (std::size_t j = 0; j < a.size(); ++j) {
        ASSERT_EQ(std::tie(a[j].layer, a[j].q_head, a[j].pos, a[j].repaired), std::tie(c[j].layer, c[j].q_head, c[j].pos, c[j].repaired));
        ASSERT_EQ(a[j].meter, c[j].meter) << "cell " << j;
        ASSERT_EQ(a[j].v_meter, c[j].v_meter) << "cell " << j;
        ASSERT_EQ(a[j].tv, c[j].tv) << "cell " << j;
        ASSERT_FALSE(violates(c[j])) << "cell " << j;
      }
      EXPECT_LE(retires.store().page_in_stats().page_ins, keeps.store().page_in_stats().page_ins);
      cells += static_cast<long>(c.size());
    }
  std::printf("[window] %ld cells of a retiring cache equal to one that keeps every page\n", cells);
}

TEST(SlidingWindow, WindowBeginFollowsTheMaskOfLlamaCppAndHuggingFace) {
  // Key t is seen from position p while p − t < W.
  EXPECT_EQ(window_begin(0, 4), 0);
  EXPECT_EQ(window_begin(3, 4), 0);
  EXPECT_EQ(window_begin(4, 4), 1);
  EXPECT_EQ(window_begin(100, 4), 97);
  EXPECT_EQ(window_begin(100, 1), 100);
  EXPECT_EQ(window_begin(100, 0), 0);  // no window
}

}  // namespace
}  // namespace witcert::gate
