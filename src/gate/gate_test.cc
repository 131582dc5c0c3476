// The gate: certified (τ < 1) and risk-ranked (τ ≥ 1) repair from the exact tier at head, block
// and request granularity (paper §4.3, §6.3.4–6.3.5).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attention/reference/certified_attention.h"
#include "gate/certified_cache.h"
#include "gate/test_log.h"
#include "kvcache/test_config.h"

namespace witcert::gate {
namespace {

using namespace witcert::attention;

constexpr int kLayers = 2, kKvHeads = 2, kGroup = 3, kDim = 64, kN = 96;

struct GateRun {
  std::vector<MeterCell> cells;
  kvcache::KvStore::PageInStats page_in;
};

kvcache::CacheConfig config(const std::string& fmt) {
  return kvcache::test_config(kLayers, kKvHeads, kDim, kN, 16, fmt, fmt, 11);
}

// Writes kN random tokens with one massive channel pair and asks every position's attention,
// as a prefill would; `after` sees the cache before it is destroyed.
template <class After>
GateRun run(const std::string& fmt, Policy gate, bool check, After after) {
  CertifiedOptions o;
  o.q_heads = kGroup * kKvHeads;
  o.gate = gate;
  o.check_soundness = check;
  CellLog log;
  CertifiedKvCache cache(config(fmt), logged(o, log));
  std::mt19937_64 rng(21);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> k(kDim), v(kDim), q(kGroup * kDim), out(kGroup * kDim);
  for (std::int64_t p = 0; p < kN; ++p) {
    for (int l = 0; l < kLayers; ++l)
      for (int h = 0; h < kKvHeads; ++h) {
        for (int i = 0; i < kDim; ++i) k[i] = g(rng) * (i == 6 || i == 7 ? 15.0f : 1.0f), v[i] = g(rng);
        cache.write(l, h, p, k.data(), v.data());
      }
    for (int l = 0; l < kLayers; ++l)
      for (int h = 0; h < kKvHeads; ++h) {
        for (float& x : q) x = 2.0f * g(rng);
        cache.attend(l, h, q.data(), kGroup, p + 1, out.data());
      }
  }
  after(cache);
  return {log.cells(), cache.store().page_in_stats()};
}

GateRun run(const std::string& fmt, Policy gate, bool check = false) {
  return run(fmt, gate, check, [](const CertifiedKvCache&) {});
}

TEST(Gate, CertifiedGatingServesEveryCellWithinTau) {
  for (Granularity gran : {Granularity::block, Granularity::head, Granularity::request}) {
    const GateRun r = run("q4_0", Policy::from_tau_k(0.2, gran), /*check=*/true);
    long repaired = 0;
    for (const MeterCell& c : r.cells) {
      ASSERT_LE(c.meter, 0.2) << "layer " << c.layer << " head " << c.q_head << " pos " << c.pos;
      ASSERT_LE(c.tv, c.meter * (1 + 1e-9) + 1e-12);
      repaired += c.repaired;
    }
    EXPECT_GT(repaired, 0) << "q4_0 at tau 0.2 must trigger repairs";
  }
}

TEST(Gate, RiskRankedGatingBoundsTheRawScore) {
  const GateRun r = run("sign-1bit", Policy::from_tau_k(4.0, Granularity::block));
  long above_before = 0;
  for (const MeterCell& c : r.cells) {
    ASSERT_LE(c.eform_raw, 4.0);
    above_before += c.raw_before > 4.0;
  }
  EXPECT_GT(above_before, 0);
}

TEST(Gate, RepairedPagesMatchTheBackingTierAndArePagedInOnce) {
  run("rtn-int4", Policy::from_tau_k(0.1, Granularity::block), false, [](const CertifiedKvCache& cache) {
    const kvcache::KvStore& st = cache.store();
    std::int64_t promoted = 0;
    for (int l = 0; l < kLayers; ++l)
      for (int h = 0; h < kKvHeads; ++h) {
        kvcache::KvStore::Reader r(st, l, h);
        std::vector<float> k(kDim), v(kDim), ek(kDim), ev(kDim);
        kvcache::KeyBound b;
        double rho;
        for (std::int64_t j = 0; j < kN / 16; ++j) {
          if (!st.promoted(l, h, j)) continue;
          ++promoted;
          for (std::int64_t p = j * 16; p < (j + 1) * 16; ++p) {
            r.key(p, k.data(), b);
            r.value(p, v.data(), rho);
            r.exact_key(p, ek.data());
            r.exact_value(p, ev.data());
            ASSERT_EQ(std::memcmp(k.data(), ek.data(), sizeof(float) * kDim), 0);
            ASSERT_EQ(std::memcmp(v.data(), ev.data(), sizeof(float) * kDim), 0);
            ASSERT_EQ(b.kind, kvcache::KeyBound::exact);
            ASSERT_EQ(rho, 0.0);
          }
        }
      }
    // Every promotion is one page-in: no page is paged in twice within the request.
    EXPECT_GT(promoted, 0);
    EXPECT_EQ(st.page_in_stats().page_ins, promoted);
  });
}

TEST(Gate, BlockPagingMovesLessThanHeadPaging) {
  const GateRun block = run("fp8-e4m3", Policy::from_tau_k(0.2, Granularity::block));
  const GateRun head = run("fp8-e4m3", Policy::from_tau_k(0.2, Granularity::head));
  std::printf("[gate] fp8-e4m3 at tau 0.2: page-in bytes block %lld, head %lld\n",
              static_cast<long long>(block.page_in.page_in_bytes), static_cast<long long>(head.page_in.page_in_bytes));
  EXPECT_LE(block.page_in.page_in_bytes, head.page_in.page_in_bytes);
  EXPECT_GT(head.page_in.page_in_bytes, 0);
}

// §6.3.5: replacing page j by exact keys removes exactly Σ_{t∈j} p̃_t (e^{c_t} − 1) from A when
// p̃ is held fixed — checked against A recomputed from scratch with c_t = 0 on the page.
TEST(Gate, AReductionIsExactInTheReference) {
  run("q8_0", {}, false, [](const CertifiedKvCache& cache) {
    kvcache::KvStore::Reader r(cache.store(), 1, 0);
    std::mt19937_64 rng(5);
    std::normal_distribution<float> g(0.0f, 2.0f);
    std::vector<float> q(kDim);
    for (float& x : q) x = g(rng);
    const BoundContext ctx{0.125, kN, 1e-4};
    std::vector<HeadPartial> whole;
    attend_range_reference(r, q.data(), 1, kDim, 0, kN, ctx, whole);
    const double A = std::exp(whole[0].meter.log_A());
    const auto term = page_contributions(r, q.data(), 1, kDim, 0, kN, ctx, {whole[0].meter.z.value()});
    double sum = 0.0;
    for (double t : term.a[0]) sum += t;
    EXPECT_NEAR(A - 1.0, sum, 1e-12 * A);  // A − 1 = Σ_j terms: the terms partition A − 1
    // The value terms partition Σ_t p̃_t ρ^v_t the same way.
    double rho = 0.0;
    for (double t : term.rho[0]) rho += t;
    EXPECT_NEAR(rho, whole[0].rho / whole[0].l, 1e-12 * (1.0 + rho));
    // A with page 2's bounds set to zero, p̃ unchanged.
    std::vector<float> k(kDim);
    kvcache::KeyBound b;
    cert::MeterStats without;
    std::vector<HeadPartial> probe;
    for (std::int64_t t = 0; t < kN; ++t) {
      r.key(t, k.data(), b);
      double z = 0.0;
      for (int i = 0; i < kDim; ++i) z += double(q[i]) * k[i];
      probe.clear();
      attend_range_reference(r, q.data(), 1, kDim, t, t + 1, ctx, probe);
      const double c = probe[0].meter.c_max;
      without.add(0.125 * z, t / 16 == 2 ? 0.0 : c);
    }
    EXPECT_NEAR(std::exp(without.log_A()), A - term.a[0][2], 1e-12 * A);
  });
}

// A NaN or Inf in a key or a query: the meter says "no guarantee" (raw +inf), the gate repairs
// every page of the head, and nothing crashes; the output is what exact attention over the same
// non-finite inputs gives, so the model's own check (non-finite logits) reports it.
TEST(Gate, NonFiniteKeyOrQueryIsNoGuaranteeAndTheGateRepairs) {
  for (const float bad : {NAN, INFINITY}) {
    for (const bool in_query : {false, true}) {
      CertifiedOptions o;
      o.q_heads = kGroup * kKvHeads;
      o.gate = Policy::from_tau_k(0.2, Granularity::block);
      CellLog log;
      CertifiedKvCache cache(config("q8_0"), logged(o, log));
      std::mt19937_64 rng(4);
      std::normal_distribution<float> g(0.0f, 1.0f);
      std::vector<float> k(kDim), v(kDim), q(kGroup * kDim), out(kGroup * kDim);
      for (std::int64_t p = 0; p < 40; ++p) {
        for (int i = 0; i < kDim; ++i) k[i] = g(rng), v[i] = g(rng);
        if (!in_query && p == 21) k[5] = bad;
        cache.write(0, 0, p, k.data(), v.data());
      }
      for (float& x : q) x = g(rng);
      if (in_query) q[kDim + 9] = bad;  // query head 1
      ASSERT_NO_THROW(cache.attend(0, 0, q.data(), kGroup, 40, out.data()));
      const std::vector<MeterCell> cells = log.cells();
      ASSERT_EQ(cells.size(), static_cast<std::size_t>(kGroup));
      bool no_guarantee = false;
      for (const MeterCell& c : cells) {
        no_guarantee |= std::isinf(c.raw_before);
        EXPECT_TRUE(c.repaired) << "any-of-G: the whole group is repaired";
      }
      EXPECT_TRUE(no_guarantee) << (in_query ? "query" : "key") << " " << bad;
      // Every page of the head was paged in: the cache holds the exact tier's keys.
      EXPECT_EQ(cache.store().page_in_stats().page_ins, 40 / 16 + 1);
    }
  }
}

TEST(Gate, RejectsImpossibleTau) {
  CertifiedOptions o;
  o.gate.set_tau_k(-0.5);
  EXPECT_THROW(CertifiedKvCache(config("q8_0"), o), std::invalid_argument);
}

// The gate's mode is a variant read once from the options' number: 0 none, below 1 certified on
// the meter, from 1 risk-ranked on the raw score; pass_K reads what the mode names.
TEST(Gate, TheModeIsAVariantReadOnceFromTauK) {
  EXPECT_EQ(Policy::mode_of(0.0), GateMode{NoGate{}});
  EXPECT_EQ(Policy::mode_of(0.2), GateMode{CertifiedGate{0.2}});
  EXPECT_EQ(Policy::mode_of(0.999), GateMode{CertifiedGate{0.999}});
  EXPECT_EQ(Policy::mode_of(1.0), GateMode{RiskRankedGate{1.0}});
  EXPECT_EQ(Policy::mode_of(50.0), GateMode{RiskRankedGate{50.0}});
  for (double t : {0.0, 0.2, 1.0, 50.0}) EXPECT_EQ(Policy::from_tau_k(t).tau_k(), t);
  HeadResult r;
  r.meter = 0.3;
  r.eform_raw = 2.0;
  r.v_meter = 0.0;
  const std::vector<HeadResult> heads{r};
  EXPECT_TRUE(Policy::from_tau_k(0.0).pass_k(r));
  EXPECT_FALSE(Policy::from_tau_k(0.0).triggered(heads));
  EXPECT_FALSE(Policy::from_tau_k(0.2).pass_k(r));  // the meter 0.3 is above τ_K
  EXPECT_TRUE(Policy::from_tau_k(0.2).triggered(heads));
  EXPECT_TRUE(Policy::from_tau_k(0.5).pass_k(r));
  EXPECT_FALSE(Policy::from_tau_k(1.5).pass_k(r));  // the raw score 2 is above the threshold
  EXPECT_TRUE(Policy::from_tau_k(3.0).pass_k(r));
  EXPECT_FALSE(Policy::from_tau_k(0.0).on());
  EXPECT_TRUE(Policy::from_tau_k(0.2).certified());
  EXPECT_FALSE(Policy::from_tau_k(3.0).certified());
  for (double bad : {-0.5, -1e-300, static_cast<double>(NAN), static_cast<double>(INFINITY)})
    EXPECT_THROW(Policy::from_tau_k(bad).validate(), std::invalid_argument) << bad;
  EXPECT_THROW(Policy::from_tau_k(0.2, Granularity::block, 0.0).validate(), std::invalid_argument);
}

}  // namespace
}  // namespace witcert::gate
