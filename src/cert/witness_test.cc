#include "cert/witness.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

namespace witcert::cert {
namespace {

// RoPE rotation at position n with the given pair layout (base 10000), in double.
std::vector<double> rope(const std::vector<double>& x, RopeLayout layout, long n) {
  const int d = static_cast<int>(x.size());
  std::vector<double> y(x);
  for (int j = 0; j < d / 2; ++j) {
    const RopePair pr = rope_pair(layout, d, j);
    const double theta = static_cast<double>(n) * std::pow(10000.0, -2.0 * j / d);
    const double cs = std::cos(theta), sn = std::sin(theta);
    y[pr.lo] = x[pr.lo] * cs - x[pr.hi] * sn;
    y[pr.hi] = x[pr.lo] * sn + x[pr.hi] * cs;
  }
  return y;
}

std::vector<float> to_float(const std::vector<double>& x) { return {x.begin(), x.end()}; }

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

TEST(Witness, PairLayouts) {
  EXPECT_EQ(rope_pair(RopeLayout::interleaved, 64, 5).lo, 10);
  EXPECT_EQ(rope_pair(RopeLayout::interleaved, 64, 5).hi, 11);
  EXPECT_EQ(rope_pair(RopeLayout::neox, 64, 5).lo, 5);
  EXPECT_EQ(rope_pair(RopeLayout::neox, 64, 5).hi, 37);
  // Every coordinate belongs to exactly one band, for both layouts and several band counts.
  for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::neox}) {
    for (int bands : {1, 2, 4, 8, 16, 32}) {
      const BandLayout bl(64, bands, layout);
      std::vector<int> seen(64, 0);
      for (int b = 0; b < bands; ++b)
        for (int i = 0; i < 2 * bl.pairs_per_band(); ++i) ++seen[bl.coordinate(b, i)];
      for (int v : seen) EXPECT_EQ(v, 1);
    }
  }
  EXPECT_THROW(BandLayout(64, 5, RopeLayout::neox), std::invalid_argument);
  EXPECT_THROW(BandLayout(63, 1, RopeLayout::neox), std::invalid_argument);
  EXPECT_THROW(BandLayout(64, 0, RopeLayout::neox), std::invalid_argument);
}

TEST(Witness, StoredWitnessIsAtLeastTheBandNorm) {
  const BandLayout bl(8, 2, RopeLayout::interleaved);
  // Residual (3, 4 | 0, 0 | 1, 1 | 1, 1): band 0 = coords 0..3 → 5, band 1 = coords 4..7 → 2.
  const std::vector<float> k(8, 0.0f), kh = {3, 4, 0, 0, 1, 1, 1, 1};
  std::vector<f16> w(2);
  tier_a_witness(bl, kh, k, w);
  // Exact fp16 values are still rounded up past the margin: never below the true norm.
  EXPECT_GE(fp16_to_double(w[0]), 5.0);
  EXPECT_LE(fp16_to_double(w[0]), 5.0 + 1.0 / 256);
  EXPECT_GE(fp16_to_double(w[1]), 2.0);
  EXPECT_LE(fp16_to_double(w[1]), 2.0 + 1.0 / 512);
}

// |ε_t| ≤ c_t for random residuals and queries, for both layouts and at random positions,
// including the Cauchy–Schwarz-tight case q_b ∥ r_b.
TEST(Witness, TheoremTwoHoldsForEveryQuery) {
  std::mt19937_64 rng(12);
  std::normal_distribution<double> n(0.0, 1.0);
  std::uniform_int_distribution<long> pos(0, 1 << 20);
  std::uniform_real_distribution<double> scale(-6.0, 2.0);
  long checked = 0;
  double tightest = 1e300;
  for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::neox}) {
    for (int d : {64, 128}) {
      for (int bands : {8, 16}) {
        const BandLayout bl(d, bands, layout);
        const double sm = 1.0 / std::sqrt(d);
        std::vector<f16> w(bands);
        std::vector<double> qn(bands);
        for (int trial = 0; trial < 3000; ++trial) {
          std::vector<double> k(d), r(d), q(d);
          const double rs = std::pow(10.0, scale(rng));
          for (int i = 0; i < d; ++i) k[i] = 4.0 * n(rng), r[i] = rs * n(rng), q[i] = 3.0 * n(rng);
          if (trial % 3 == 0)  // tight: the query is parallel to the residual in every band
            for (int i = 0; i < d; ++i) q[i] = (trial % 2 ? -2.5 : 1.5) * r[i] / rs;
          // The cache holds post-RoPE keys: the witness is taken at the key's position n.
          const long kn = pos(rng), qm = trial % 3 == 0 ? kn : pos(rng);
          std::vector<double> kr = rope(k, layout, kn), rr = rope(r, layout, kn), kh(d);
          for (int i = 0; i < d; ++i) kh[i] = kr[i] + rr[i];
          const std::vector<float> khf = to_float(kh), kf = to_float(kr);
          tier_a_witness(bl, khf, kf, w);
          const std::vector<double> qr = rope(q, layout, qm);
          const std::vector<float> qf = to_float(qr);
          band_norms(bl, qf, qn);
          const double c = tier_a_c(qn, w, sm);
          // ε with the residual actually stored (float keys) and the float query used above.
          std::vector<double> res(d), qd(d);
          for (int i = 0; i < d; ++i) res[i] = double(khf[i]) - double(kf[i]), qd[i] = qf[i];
          const double eps = sm * dot(qd, res);
          ASSERT_LE(std::fabs(eps), c) << "trial " << trial << " d=" << d;
          if (std::fabs(eps) > 0) tightest = std::min(tightest, c / std::fabs(eps));
          ++checked;
        }
      }
    }
  }
  std::printf("[tier-a] %ld queries, tightest c/|eps| = %.9f\n", checked, tightest);
  EXPECT_LT(tightest, 1.01) << "the tight case must come close to equality";
}

// Lemma 1: the band norms of a residual do not change under RoPE at any position, when the
// band map follows the model's pair layout; with the wrong layout they do.
TEST(Witness, LemmaOneInvarianceUnderRope) {
  std::mt19937_64 rng(21);
  std::normal_distribution<double> n(0.0, 1.0);
  std::uniform_int_distribution<long> pos(1, 1 << 16);
  for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::neox}) {
    const RopeLayout wrong = layout == RopeLayout::neox ? RopeLayout::interleaved : RopeLayout::neox;
    // One pair per band for the wrong map: every band then splits a true RoPE pair. (With two
    // pairs per band, NeoX bands happen to be unions of interleaved pairs.)
    const BandLayout bl(64, 16, layout), bad(64, 32, wrong);
    std::vector<double> n0(32), n1(32);
    int changed_with_wrong_map = 0, fp16_steps = 0;
    for (int trial = 0; trial < 2000; ++trial) {
      std::vector<double> r(64);
      for (double& x : r) x = n(rng);
      const std::vector<double> rr = rope(r, layout, pos(rng));
      const std::vector<float> rf = to_float(r), rrf = to_float(rr), zero(64, 0.0f);
      // Band norms in double: equal to rounding.
      band_norms(bl, to_float(r), n0);
      std::vector<double> exact0(16), exact1(16);
      for (int b = 0; b < 16; ++b) {
        for (int i = 0; i < 4; ++i) {
          exact0[b] += r[bl.coordinate(b, i)] * r[bl.coordinate(b, i)];
          exact1[b] += rr[bl.coordinate(b, i)] * rr[bl.coordinate(b, i)];
        }
        ASSERT_NEAR(std::sqrt(exact0[b]), std::sqrt(exact1[b]), 1e-12 * (1 + std::sqrt(exact0[b])));
      }
      // The stored fp16 witness: identical, or one fp16 step apart when the norm sits on a
      // rounding boundary (the float residuals differ by their own rounding).
      std::vector<f16> w0(16), w1(16);
      tier_a_witness(bl, rf, zero, w0);
      tier_a_witness(bl, rrf, zero, w1);
      for (int b = 0; b < 16; ++b) {
        ASSERT_LE(std::abs(int(w0[b]) - int(w1[b])), 1);
        fp16_steps += w0[b] != w1[b];
      }
      // The wrong pair map is not invariant.
      band_norms(bad, rf, n0);
      band_norms(bad, rrf, n1);
      for (int b = 0; b < 32; ++b) changed_with_wrong_map += std::fabs(n0[b] - n1[b]) > 0.01 * n0[b];
    }
    EXPECT_LT(fp16_steps, 2000 * 16 / 100) << "boundary cases must be rare";
    EXPECT_GT(changed_with_wrong_map, 2000) << "a band map that ignores the layout must be detected";
  }
}

TEST(Witness, ZeroQueryBandIgnoresInfiniteWitness) {
  const std::vector<double> qn = {0.0, 2.0};
  const std::vector<f16> w = {kFp16PosInf, 0x3C00};  // inf, 1.0
  EXPECT_NEAR(tier_a_c(qn, w, 0.5), 1.0, 1e-9);
  const std::vector<double> qn2 = {1.0, 2.0};
  EXPECT_EQ(tier_a_c(qn2, w, 0.5), INFINITY);
  const std::vector<f16> wnan = {0x7E00, 0x3C00};
  EXPECT_EQ(tier_a_c(qn2, wnan, 0.5), INFINITY);
}

}  // namespace
}  // namespace witcert::cert
