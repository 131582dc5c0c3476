// KvCache::attend_causal, the prefill path: CertifiedKvCache reads the shared prefix once for a
// run of query positions. Each position must get what a call of attend of its own gives: the same
// output, the same meter for the Tier-A schemes (whose c_t does not depend on S), and for
// dither-int8 a meter at least as large (the run's union bound is over its longest context).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "gate/certified_cache.h"
#include "gate/test_log.h"
#include "kvcache/test_config.h"

namespace witcert::gate {
namespace {

using namespace witcert::attention;
using kvcache::KvCache;

constexpr int kGroup = 3, kDim = 64, kN = 80;

kvcache::CacheConfig config(const std::string& fmt, int page_size) {
  return kvcache::test_config(1, 1, kDim, kN, page_size, fmt, fmt, 5);
}

// kN tokens with one massive channel pair, and kN × group queries.
struct Data {
  std::vector<float> k, v, q;
};

Data data(unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  Data d;
  for (int t = 0; t < kN; ++t)
    for (int i = 0; i < kDim; ++i) {
      d.k.push_back(g(rng) * (i == 6 || i == 7 ? 12.0f : 1.0f));
      d.v.push_back(g(rng));
    }
  for (int i = 0; i < kN * kGroup * kDim; ++i) d.q.push_back(1.5f * g(rng));
  return d;
}

void fill(CertifiedKvCache& c, const Data& d) {
  for (int t = 0; t < kN; ++t) c.write(0, 0, t, &d.k[t * kDim], &d.v[t * kDim]);
}

TEST(AttendCausal, EveryPositionGetsItsOwnAttentionAndAMeterAtLeastAsLarge) {
  const std::int64_t row = kGroup * kDim;
  for (const std::string fmt : {"q8_0", "q4_0", "fp8-e4m3", "rtn-int8", "kivi-2bit", "dither-int4", "dither-int6", "dither-int8"})
    for (int page : {1, 16})
      for (auto [pos0, n] : std::vector<std::pair<int, int>>{{0, 16}, {16, 16}, {37, 5}, {64, 16}, {79, 1}}) {
        SCOPED_TRACE(fmt + " page " + std::to_string(page) + " pos0 " + std::to_string(pos0) + " n " +
                     std::to_string(n));
        const Data d = data(7 + page);
        CertifiedOptions o;
        o.q_heads = kGroup;
        o.check_soundness = true;
        CellLog run_log, single_log;
        CertifiedKvCache run(config(fmt, page), logged(o, run_log)), single(config(fmt, page), logged(o, single_log));
        fill(run, d);
        fill(single, d);
        std::vector<float> got(n * row), want(n * row);
        run.attend_causal(0, 0, &d.q[pos0 * row], row, kGroup, pos0, n, 0, got.data(), row);
        for (int i = 0; i < n; ++i) single.attend(0, 0, &d.q[(pos0 + i) * row], kGroup, pos0 + i + 1, &want[i * row]);
        for (int i = 0; i < n; ++i)
          for (int h = 0; h < kGroup; ++h) {
            double err = 0.0, scale = 0.0;
            for (int c = 0; c < kDim; ++c) {
              const std::size_t at = i * row + h * kDim + c;
              err = std::max(err, std::fabs(double(got[at]) - want[at]));
              scale = std::max(scale, std::fabs(double(want[at])));
            }
            ASSERT_LE(err, 1e-5 * scale) << "position " << pos0 + i << " head " << h;
          }
        const std::vector<MeterCell> a = run_log.cells(), b = single_log.cells();
        ASSERT_EQ(a.size(), b.size());
        for (std::size_t j = 0; j < a.size(); ++j) {
          ASSERT_EQ(a[j].pos, b[j].pos);
          ASSERT_EQ(a[j].q_head, b[j].q_head);
          ASSERT_LE(a[j].tv, a[j].meter * (1 + 1e-9) + 1e-12) << "unsound at cell " << j;
          if (kvcache::dithered(fmt)) {
            ASSERT_GE(a[j].eform_raw, b[j].eform_raw * (1 - 1e-9)) << "cell " << j;
          } else {
            ASSERT_NEAR(a[j].eform_raw, b[j].eform_raw, 1e-6 * b[j].eform_raw + 1e-12) << "cell " << j;
            ASSERT_NEAR(a[j].meter, b[j].meter, 1e-6 * b[j].meter + 1e-12) << "cell " << j;
          }
        }
      }
}

TEST(AttendCausal, GatedRunServesEveryPositionWithinTau) {
  const std::int64_t row = kGroup * kDim;
  for (Granularity gran : {Granularity::block, Granularity::head}) {
    const Data d = data(3);
    CertifiedOptions o;
    o.q_heads = kGroup;
    o.check_soundness = true;
    o.gate = Policy::from_tau_k(0.2, gran);
    CellLog log;
    CertifiedKvCache cache(config("q4_0", 16), logged(o, log));
    fill(cache, d);
    std::vector<float> out(kN * row);
    for (int pos0 = 0; pos0 < kN; pos0 += 16)
      cache.attend_causal(0, 0, &d.q[pos0 * row], row, kGroup, pos0, std::min(16, kN - pos0), 0, &out[pos0 * row], row);
    const std::vector<MeterCell> cells = log.cells();
    ASSERT_EQ(cells.size(), static_cast<std::size_t>(kN * kGroup));
    int repaired = 0;
    for (const MeterCell& c : cells) {
      ASSERT_LE(c.meter, 0.2) << "pos " << c.pos;
      ASSERT_LE(c.tv, c.meter * (1 + 1e-9) + 1e-12) << "pos " << c.pos;
      repaired += c.repaired;
    }
    EXPECT_GT(repaired, 0) << "q4_0 with a massive channel must trigger repairs at tau 0.2";
    for (float x : out) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(AttendCausal, ExactCacheRunEqualsAttendBitForBit) {
  const Data d = data(11);
  ExactKvCache cache({1, 1, kDim, kN});
  for (int t = 0; t < kN; ++t) cache.write(0, 0, t, &d.k[t * kDim], &d.v[t * kDim]);
  const std::int64_t row = kGroup * kDim;
  std::vector<float> got(16 * row), want(16 * row);
  cache.attend_causal(0, 0, &d.q[40 * row], row, kGroup, 40, 16, 0, got.data(), row);
  for (int i = 0; i < 16; ++i) cache.attend(0, 0, &d.q[(40 + i) * row], kGroup, 41 + i, &want[i * row]);
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace witcert::gate
