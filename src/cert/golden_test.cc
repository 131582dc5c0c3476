// A 50-digit golden written from the formulas of the paper alone (A as a plain expectation,
// TV from its definition), not from the log-domain double code, which must match it.
#include <gtest/gtest.h>

#include <boost/multiprecision/cpp_dec_float.hpp>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cert/meter.h"
#include "cert/subgaussian.h"
#include "cert/witness.h"

namespace witcert::cert {
namespace {

using Big = boost::multiprecision::cpp_dec_float_50;

struct Golden {
  Big eform, two_sided, retention, tanh, tanh_half, tv;
};

// Straight from the statements: A = E_p̃[e^c], A⁻ = E_p̃[e^{−c}], Theorem 1, Proposition 1,
// the retention form, the tanh shapes, and TV(p, p̃) with p ∝ p̃ e^{−ε}.
Golden golden(const std::vector<double>& p_in, const std::vector<double>& c_in,
              const std::vector<double>& eps_in) {
  const std::size_t S = p_in.size();
  std::vector<Big> p(S), c(S), eps(S);
  for (std::size_t t = 0; t < S; ++t) p[t] = p_in[t], c[t] = c_in[t], eps[t] = eps_in[t];
  Big total = 0;
  for (const Big& x : p) total += x;
  for (Big& x : p) x /= total;  // the double code normalises through the log-sum-exp too
  Big A = 0, Am = 0, cmax = 0;
  for (std::size_t t = 0; t < S; ++t) {
    A += p[t] * exp(c[t]);
    Am += p[t] * exp(-c[t]);
    if (c[t] > cmax) cmax = c[t];
  }
  Golden g;
  g.eform = (A * A - 1) / 2;
  g.two_sided = (A / Am - Am / A) / 2;
  Big r = 0;
  for (std::size_t t = 0; t < S; ++t) {
    const Big one_sided = A * exp(c[t]) - 1;
    const Big up = exp(c[t]) / Am - 1, down = 1 - exp(-c[t]) / A;
    const Big two = up > down ? up : down;
    r += p[t] * (one_sided < two ? one_sided : two);
  }
  g.retention = r / 2;
  g.tanh = tanh(cmax);
  g.tanh_half = tanh(cmax / 2);
  Big Z = 0;
  for (std::size_t t = 0; t < S; ++t) Z += p[t] * exp(-eps[t]);
  Big tv = 0;
  for (std::size_t t = 0; t < S; ++t) tv += abs(p[t] * exp(-eps[t]) / Z - p[t]);
  g.tv = tv / 2;
  return g;
}

// The double code may round up (it carries explicit rounding margins) but never below the
// exact value; the log-domain difference has absolute accuracy ~1e-13 on log A, hence the
// absolute term of the tolerance.
void expect_rel(double got, const Big& want, double rel, const char* what, double abs = 1e-12) {
  const double w = want.convert_to<double>();
  EXPECT_NEAR(got, w, rel * std::fabs(w) + abs) << what;
}

void expect_sound(double got, const Big& want, const char* what) {
  EXPECT_GE(Big(got), want) << what << ": the double bound fell below its exact value";
}

TEST(Golden, DoubleImplementationMatchesFiftyDigits) {
  std::mt19937_64 rng(99);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  constexpr double kRel = 1e-11;  // stated tolerance for the double implementation
  for (int trial = 0; trial < 300; ++trial) {
    const int S = 2 + static_cast<int>(u(rng) * 200);
    const double cscale = std::exp(std::log(1e-4) + u(rng) * std::log(1e5));  // 1e-4 .. 10
    std::vector<double> p(S), c(S), eps(S);
    double s = 0.0;
    for (int t = 0; t < S; ++t) s += p[t] = std::exp(6.0 * u(rng));
    for (int t = 0; t < S; ++t) {
      p[t] /= s;
      c[t] = cscale * u(rng);
      eps[t] = (2.0 * u(rng) - 1.0) * c[t];
    }
    const Golden g = golden(p, c, eps);
    const Bounds b = evaluate(p, c);
    expect_rel(b.eform, g.eform, kRel, "eform");
    expect_rel(b.two_sided, g.two_sided, kRel, "two_sided");
    expect_rel(b.retention, g.retention, kRel, "retention");
    expect_rel(b.tanh, g.tanh, kRel, "tanh");
    expect_rel(b.tanh_half, g.tanh_half, kRel, "tanh_half");
    expect_rel(true_tv(p, eps), g.tv, kRel, "tv", 1e-15);
    expect_sound(b.eform, g.eform, "eform");
    expect_sound(b.two_sided, g.two_sided, "two_sided");
    expect_sound(b.retention, g.retention, "retention");
    expect_sound(b.tanh, g.tanh, "tanh");
    expect_sound(b.tanh_half, g.tanh_half, "tanh_half");
  }
}

TEST(Golden, OverflowOnlyWhereTheTrueValueExceedsDoubleRange) {
  // Around e^{355}: the double e-form is +inf exactly when ½(A² − 1) exceeds DBL_MAX.
  const Big dbl_max = std::numeric_limits<double>::max();
  for (double c0 = 340.0; c0 <= 370.0; c0 += 0.25) {
    const std::vector<double> p = {0.5, 0.5}, c = {c0, 0.0}, eps = {0.0, 0.0};
    const Golden g = golden(p, c, eps);
    const double got = evaluate(p, c).eform;
    if (g.eform > dbl_max) {
      EXPECT_EQ(got, std::numeric_limits<double>::infinity()) << c0;
    } else {
      expect_rel(got, g.eform, 1e-11, "large eform");
      expect_sound(got, g.eform, "large eform");
    }
  }
}

TEST(Golden, SubGaussianRadiusAndBudget) {
  // u = sqrt(2 ς² log(2S/δ_loc)) + 2^-17 sqrt(12 D) ς, δ_loc = δ/(L·H·T).
  const double dl = delta_loc(1e-2, 30, 9, 256);
  EXPECT_DOUBLE_EQ(dl, 1e-2 / (30.0 * 9.0 * 256.0));
  for (double varsigma2 : {1e-8, 1e-3, 0.25, 7.0}) {
    for (long S : {1L, 100L, 8192L, 1L << 20}) {
      const Big v = varsigma2, two_S = 2 * static_cast<double>(S), d = dl;
      const Big want = sqrt(2 * v * log(two_S / d)) + pow(Big(2), -17) * sqrt(Big(12 * 64)) * sqrt(v);
      const double got = subgaussian_radius(varsigma2, S, dl, 64);
      expect_rel(got, want, 1e-11, "u_t");
      EXPECT_GE(Big(got), want) << "the radius must not be rounded below its exact value";
    }
  }
}

TEST(Golden, TierAWitnessBound) {
  // c_t = sm Σ_b ‖q_b‖ w_b, with the witness as stored (fp16, rounded up).
  std::mt19937_64 rng(4);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const BandLayout bl(64, 16, RopeLayout::neox);
  std::vector<float> q(64), k(64), kh(64);
  std::vector<f16> w(16);
  std::vector<double> qn(16);
  for (int trial = 0; trial < 200; ++trial) {
    for (int i = 0; i < 64; ++i) q[i] = n(rng), k[i] = n(rng), kh[i] = k[i] + 0.01f * n(rng);
    tier_a_witness(bl, kh, k, w);
    band_norms(bl, q, qn);
    const double sm = 1.0 / 8.0;
    Big want = 0;
    for (int b = 0; b < 16; ++b) {
      Big qb = 0, rb = 0;
      for (int i = 0; i < 4; ++i) {
        const int ch = bl.coordinate(b, i);
        qb += Big(q[ch]) * Big(q[ch]);
        rb += (Big(kh[ch]) - Big(k[ch])) * (Big(kh[ch]) - Big(k[ch]));
      }
      EXPECT_GE(Big(fp16_to_double(w[b])), sqrt(rb)) << "witness below the band norm";
      want += sqrt(qb) * Big(fp16_to_double(w[b]));
    }
    want *= Big(sm);
    const double got = tier_a_c(qn, w, sm);
    EXPECT_GE(Big(got), want);
    expect_rel(got, want, 1e-11, "c_t");
  }
}

}  // namespace
}  // namespace witcert::cert
