#include "cert/meter.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <boost/multiprecision/cpp_bin_float.hpp>
#include <boost/multiprecision/cpp_dec_float.hpp>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cert/round_up.h"
#include "cert/unsound_form_for_tests.h"

namespace witcert::cert {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A computed bound is its exact value raised by at most the documented rounding margins
// (relative ~1e-12): never below it.
void expect_upper(double got, double exact) {
  EXPECT_GE(got, exact);
  EXPECT_LE(got, exact * (1.0 + 1e-11) + 1e-15);
}

// float_round_up: the least float ≥ x, by hand on exact floats, values between two floats, the
// edges of the float range, and NaN.
TEST(RoundUp, FloatRoundUpIsTheLeastFloatNotBelow) {
  EXPECT_EQ(float_round_up(1.0), 1.0f);
  EXPECT_EQ(float_round_up(0.0), 0.0f);
  EXPECT_EQ(float_round_up(1.0 + 0x1p-30), 1.0f + 0x1p-23f);  // rounds to nearest 1, taken up
  EXPECT_EQ(float_round_up(1.0 + 0x1p-23 + 0x1p-40), 1.0f + 0x1p-22f);
  EXPECT_EQ(float_round_up(-1.0 - 0x1p-30), -1.0f);  // towards +inf
  EXPECT_EQ(float_round_up(0.2), 0.2f);  // 0.2f is above 0.2
  EXPECT_EQ(float_round_up(0.7), std::nextafter(0.7f, 1.0f));  // 0.7f is below 0.7
  EXPECT_EQ(float_round_up(0x1p-160), std::numeric_limits<float>::denorm_min());
  EXPECT_EQ(float_round_up(3.5e38), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(float_round_up(std::nan(""))));
}

TEST(Meter, CounterexampleGuard) {
  const std::array<double, 2> p = {0.5, 0.5}, c = {0.1, 0.1}, eps = {0.1, -0.1};
  const double tv = true_tv(p, eps);
  EXPECT_NEAR(tv, 0.049834, 5e-7);
  EXPECT_NEAR(testing::unsound_form(p, c), 0.006423, 5e-7);
  EXPECT_LT(testing::unsound_form(p, c), tv);  // the flawed form is violated ...

  const Bounds b = evaluate(p, c);  // ... and every sound form holds.
  expect_upper(b.eform, 0.5 * std::expm1(0.2));
  expect_upper(b.tanh, std::tanh(0.1));
  expect_upper(b.tanh_half, std::tanh(0.05));
  expect_upper(b.two_sided, std::sinh(0.2));  // A/A⁻ = e^{0.2}
  for (double v : {b.eform, b.two_sided, b.retention, b.tanh, b.tanh_half, b.meter()}) EXPECT_GE(v, tv);
  expect_upper(b.meter(), std::tanh(0.05));
}

TEST(Meter, KnownAnswersByHand) {
  // p̃ = (0.25, 0.75), c = (ln 2, 0): A = 0.25·2 + 0.75 = 1.25, A⁻ = 0.125 + 0.75 = 0.875.
  const std::array<double, 2> p = {0.25, 0.75}, c = {std::log(2.0), 0.0};
  const Bounds b = evaluate(p, c);
  expect_upper(b.eform, 0.5 * (1.25 * 1.25 - 1.0));
  expect_upper(b.two_sided, 0.5 * (1.25 / 0.875 - 0.875 / 1.25));
  // Retention: token 1: min(1.25·2−1, max(2/0.875−1, 1−0.5/1.25)) = min(1.5, 1.285714…) ;
  //            token 2: min(1.25−1, max(1/0.875−1, 1−1/1.25)) = min(0.25, 0.2).
  const double expect = 0.5 * (0.25 * (2.0 / 0.875 - 1.0) + 0.75 * 0.2);
  expect_upper(b.retention, expect);
  expect_upper(b.tanh, std::tanh(std::log(2.0)));  // = 0.6
  expect_upper(b.tanh, 0.6);
}

TEST(Meter, ZeroErrorGivesZeroMeter) {
  const std::vector<double> p = {0.1, 0.2, 0.3, 0.4}, c(4, 0.0);
  const Bounds b = evaluate(p, c);
  EXPECT_EQ(b.eform, 0.0);
  EXPECT_EQ(b.two_sided, 0.0);
  EXPECT_EQ(b.retention, 0.0);
  EXPECT_EQ(b.meter(), 0.0);
}

TEST(Meter, OverflowIsInfiniteNeverTruncated) {
  // c = 1000 overflows e^c; the raw score must be +inf, the meter 1, and nothing NaN.
  const std::array<double, 3> p = {0.5, 0.25, 0.25}, c = {1000.0, 0.0, 0.0};
  const Bounds b = evaluate(p, c);
  EXPECT_EQ(b.eform, kInf);
  EXPECT_EQ(b.meter(), 1.0);
  EXPECT_FALSE(std::isnan(b.two_sided));
  EXPECT_FALSE(std::isnan(b.retention));
  // log A ≈ 400 + log 0.5 stays finite in the log domain while A² exceeds the double range:
  // the e-form is then +inf, never a wrapped or truncated value.
  const std::array<double, 2> p2 = {0.5, 0.5}, c2 = {400.0, 0.0};
  MeterStats s;
  for (int t = 0; t < 2; ++t) s.add(std::log(p2[t]), c2[t]);
  EXPECT_NEAR(s.log_A(), 400.0 + std::log(0.5), 1e-9);
  EXPECT_EQ(eform_raw(s.log_A()), kInf);
  // Just below the double range the value is finite: ½(A² − 1) must not overflow early.
  EXPECT_TRUE(std::isfinite(eform_raw(354.0)));
  EXPECT_NEAR(eform_raw(354.0) / (0.5 * std::exp(708.0)), 1.0, 1e-11);
}

TEST(Meter, TinyCIsAccurateAndNeverBelowTheExactValue) {
  // ½(A² − 1) for A = e^{1e-9} is 1e-9 + O(1e-18). log A is a difference of two log-sum-exps,
  // so its accuracy is absolute (a few ulps of the LSE values), and the rounding margin keeps
  // the computed value above the exact one.
  const std::array<double, 2> p = {0.5, 0.5}, c = {1e-9, 1e-9};
  const double e = evaluate(p, c).eform;
  EXPECT_GE(e, 1e-9);
  EXPECT_NEAR(e, 1e-9, 1e-14);
}

// Float weights (MeterStats::float_c_max): every weight of a float token is perturbed by the largest
// relative error the model allows, |ε_t| = 2^-20 + 2^-24·|z̃_t − m| (m the max logit), with the sign
// that pushes A down and A⁻ up (below A: weight up; above: down). log_A and log_A_minus must still
// bound the exact values, query by query, for all-float cells and for cells where exact tokens
// carry larger c_t than the float ones; and the same cells without the allowance must fail, or the
// adversary is too weak to test anything.
TEST(Meter, FloatWeightAllowanceCoversAdversarialWeights) {
  std::mt19937_64 rng(7);
  long cells = 0, caught_without = 0;
  for (long n : {1L, 2L, 17L, 300L, 5000L})
    for (double spread : {0.1, 5.0, 40.0})
      for (double c_top : {1e-4, 0.05, 0.5, 3.0})
        for (int mixed = 0; mixed < 2; ++mixed) {
          std::normal_distribution<double> g(0.0, spread);
          std::uniform_real_distribution<double> u(0.0, 1.0);
          std::vector<double> z(n), c(n);
          std::vector<char> is_float(n);
          double f = -1.0;
          for (long t = 0; t < n; ++t) {
            z[t] = g(rng);
            is_float[t] = !mixed || t % 3 != 0;
            c[t] = c_top * u(rng) * (is_float[t] ? 1.0 : 2.0);
            if (is_float[t]) f = std::max(f, c[t]);
          }
          const double m = *std::max_element(z.begin(), z.end());
          long double w = 0, a = 0, am = 0;
          for (long t = 0; t < n; ++t) {
            const long double e = std::exp(static_cast<long double>(z[t] - m));
            w += e, a += e * std::exp(static_cast<long double>(c[t])), am += e * std::exp(-static_cast<long double>(c[t]));
          }
          const double log_A = static_cast<double>(std::log(a / w)), log_Am = static_cast<double>(std::log(am / w));
          const double A = std::exp(log_A), Am = std::exp(log_Am);
          for (int side = 0; side < 2; ++side) {
            MeterStats s, bare;
            for (long t = 0; t < n; ++t) {
              double zt = z[t];
              if (is_float[t]) {
                const double eps = 0x1p-20 + 0x1p-24 * std::fabs(z[t] - m);
                const bool above = side == 0 ? std::exp(c[t]) > A : std::exp(-c[t]) > Am;
                zt += std::log1p(above ? -eps : eps);
              }
              s.add(zt, c[t]);
              bare.add(zt, c[t]);
            }
            s.float_c_max = f;
            ++cells;
            if (side == 0) {
              EXPECT_GE(s.log_A(), log_A) << "n " << n << " spread " << spread << " c " << c_top << " mixed " << mixed;
              caught_without += bare.log_A() < log_A;
            } else {
              EXPECT_LE(s.log_A_minus(), log_Am) << "n " << n << " spread " << spread << " c " << c_top << " mixed " << mixed;
              caught_without += bare.log_A_minus() > log_Am;
            }
          }
        }
  EXPECT_GT(caught_without, cells / 4) << "the adversarial weights should beat the bare LSE margin";
  // Known answers: no float weights, no shift; the allowance's size at n = 1 and n = e^10.
  EXPECT_EQ(float_weight_error(1), (0x1p-20 * (1.0 + 0x1p-40) + 0x1p-125) / (1.0 - 0x1p-20) * (1.0 + 0x1p-40));
  EXPECT_NEAR(float_weight_error(22026), 0x1p-20 + 10.0 * 0x1p-24, 1e-9);
}

TEST(Meter, NanPoisonsEveryFormToNoGuarantee) {
  const std::array<double, 3> p = {0.5, 0.25, 0.25};
  const std::array<double, 3> c_nan = {0.1, NAN, 0.1};
  const Bounds b = evaluate(p, c_nan);
  EXPECT_EQ(b.eform, kInf);
  EXPECT_EQ(b.tanh, kInf);
  EXPECT_EQ(b.tanh_half, kInf);
  EXPECT_EQ(b.meter(), 1.0);
  const std::array<double, 3> z_nan = {0.0, NAN, 1.0}, c = {0.1, 0.1, 0.1};
  EXPECT_EQ(evaluate_logits(z_nan, c).meter(), 1.0);
  const std::array<double, 3> z_inf = {0.0, kInf, 1.0};
  EXPECT_EQ(evaluate_logits(z_inf, c).meter(), 1.0);
  EXPECT_EQ(clamp_meter(NAN), 1.0);
}

TEST(Meter, ZeroMassTokensCannotMoveMass) {
  // A token with p̃_t = 0 has p_t = 0 whatever its error: an infinite c there changes nothing.
  const std::array<double, 3> p = {0.5, 0.5, 0.0}, c = {0.1, 0.1, kInf};
  const std::array<double, 2> p2 = {0.5, 0.5}, c2 = {0.1, 0.1};
  const Bounds a = evaluate(p, c), b = evaluate(p2, c2);
  EXPECT_DOUBLE_EQ(a.eform, b.eform);
  EXPECT_DOUBLE_EQ(a.meter(), b.meter());
}

TEST(Meter, LogitsAndProbabilitiesAgree) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> z(0.0, 3.0);
  std::uniform_real_distribution<double> cu(0.0, 0.5);
  std::vector<double> logits(50), p(50), c(50);
  for (int t = 0; t < 50; ++t) {
    logits[t] = z(rng) + 7.0;  // any offset
    c[t] = cu(rng);
  }
  double m = -kInf, s = 0.0;
  for (double v : logits) m = std::max(m, v);
  for (double v : logits) s += std::exp(v - m);
  for (int t = 0; t < 50; ++t) p[t] = std::exp(logits[t] - m) / s;
  const Bounds a = evaluate_logits(logits, c), b = evaluate(p, c);
  EXPECT_NEAR(a.eform, b.eform, 1e-11 * b.eform);
  EXPECT_NEAR(a.two_sided, b.two_sided, 1e-11 * b.two_sided);
  EXPECT_NEAR(a.retention, b.retention, 1e-11 * b.retention);
}

// Per-token tokens alone, and three in four of them moment tokens (add_moment).
TEST(Meter, SplitKvMergeEqualsOnePass) {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> z(0.0, 4.0);
  std::uniform_real_distribution<double> cu(0.0, 2.0);
  const int S = 1000;
  std::vector<double> logits(S), c(S);
  for (int t = 0; t < S; ++t) logits[t] = z(rng), c[t] = cu(rng);
  for (bool moments : {false, true}) {
    const auto add = [&](MeterStats& s, int t) {
      moments && t % 4 != 0 ? s.add_moment(logits[t], c[t]) : s.add(logits[t], c[t]);
    };
    MeterStats whole;
    for (int t = 0; t < S; ++t) add(whole, t);
    for (int splits : {2, 3, 8, 17}) {
      std::vector<MeterStats> parts(splits);
      for (int t = 0; t < S; ++t) add(parts[t * splits / S], t);
      MeterStats merged;
      for (int i = splits - 1; i >= 0; --i) merged.merge(parts[i]);  // any order
      EXPECT_NEAR(merged.log_A(), whole.log_A(), 1e-12) << splits << " moments " << moments;
      EXPECT_NEAR(merged.log_A_minus(), whole.log_A_minus(), 1e-12) << splits << " moments " << moments;
      EXPECT_NEAR(merged.mom_c2, whole.mom_c2, 1e-12 * whole.mom_c2) << splits;
      EXPECT_EQ(merged.c_max, whole.c_max);
    }
    MeterStats empty;
    MeterStats copy = whole;
    copy.merge(empty);
    EXPECT_EQ(copy.log_A(), whole.log_A());
  }
}

// h(x) = (e^x − 1 − x)/x² against long double: never below, within 2^-38 above, on a sweep
// across the series branch (x ≤ 1/8), the expm1 branch and the overflow edge.
TEST(Meter, ExcessRatioIsAnUpperBoundAndTight) {
  const auto exact = [](long double x) {
    if (x < 0.01L) {  // the series Σ x^k/(k + 2)!, to far below long double's ulp
      long double term = 0.5L, sum = 0.0L;
      for (int k = 0; k < 12; ++k) sum += term, term *= x / (k + 3);
      return sum;
    }
    return (std::expm1(x) - x) / (x * x);
  };
  EXPECT_GE(expm1_excess_upper(0.0), 0.5);
  EXPECT_LE(expm1_excess_upper(0.0), 0.5 * (1 + 0x1p-47));
  std::vector<double> xs{1e-300, 1e-9, 0.1, 0.125, std::nextafter(0.125, 1.0), 0.5, 1.0, 20.0, 700.0, 709.0};
  for (double x = 1e-6; x < 709.0; x *= 1.37) xs.push_back(x);
  for (double x : xs) {
    const long double want = exact(x);
    EXPECT_GE(expm1_excess_upper(x), want) << x;
    EXPECT_LE(expm1_excess_upper(x), want * (1 + 0x1p-38L)) << x;
  }
  EXPECT_EQ(expm1_excess_upper(709.5), kInf);
  EXPECT_EQ(expm1_excess_upper(kInf), kInf);
  EXPECT_TRUE(std::isnan(expm1_excess_upper(NAN)));
}

// Moment tokens (MeterStats::add_moment), query by query against long-double A and A⁻: cells of
// moment tokens alone and mixed with per-token ones, logits from flat to peaked, c_t uniform,
// heavy-tailed (one large c_t on the heaviest token, or on a light one) and up to 30. log_A never
// below log A, log_A_minus never above log A⁻, and for moment-only cells log_A within the
// derived slack: log B − log A ≤ (h(c_max) − ½)·Σp̃c² ≤ (h(c_max) − ½)·c_max·log A (Jensen: log A ≥ Σp̃c),
// plus the rounding margin log_A adds.
TEST(Meter, MomentTokensBoundEveryQuery) {
  std::mt19937_64 rng(19);
  long cells = 0;
  for (long n : {1L, 2L, 5L, 64L, 3000L})
    for (double spread : {0.1, 5.0, 40.0})
      for (double c_top : {1e-6, 0.05, 0.5, 3.0, 30.0})
        for (int shape = 0; shape < 3; ++shape)
          for (int mixed = 0; mixed < 2; ++mixed) {
            std::normal_distribution<double> g(0.0, spread);
            std::uniform_real_distribution<double> u(0.0, 1.0);
            std::vector<double> z(n), c(n);
            for (long t = 0; t < n; ++t) z[t] = g(rng), c[t] = c_top * (shape == 0 ? u(rng) : 0.01 * u(rng));
            const long top = std::max_element(z.begin(), z.end()) - z.begin();
            if (shape == 1) c[top] = c_top;
            if (shape == 2) c[(top + 1) % n] = c_top;
            MeterStats s;
            long double w = 0, a = 0, am = 0;
            for (long t = 0; t < n; ++t) {
              if (mixed && t % 3 == 0)
                s.add(z[t], c[t]);
              else
                s.add_moment(z[t], c[t]);
              const long double e = std::exp(static_cast<long double>(z[t] - z[top]));
              w += e, a += e * std::exp(static_cast<long double>(c[t])), am += e * std::exp(-static_cast<long double>(c[t]));
            }
            const long double log_A = std::log(a / w), log_Am = std::log(am / w);
            const std::string where = "n " + std::to_string(n) + " spread " + std::to_string(spread) + " c " +
                                      std::to_string(c_top) + " shape " + std::to_string(shape) + " mixed " + std::to_string(mixed);
            ++cells;
            EXPECT_GE(s.log_A(), log_A) << where;
            EXPECT_LE(s.log_A_minus(), log_Am) << where;
            if (!mixed && c_top <= 0.5) {
              EXPECT_LE(s.log_A(), log_A * (1 + (expm1_excess_upper(s.c_max) - 0.5) * s.c_max) +
                        2 * lse_rounding_margin(2 * n, s.z.value(), s.z.value())) << where;
            }
          }
  EXPECT_EQ(cells, 5 * 3 * 5 * 3 * 2);
}

// Where every c_t is the same c the moment bounds are exact: 1 + c + h(c)·c² = e^c, and Jensen's
// e^{−Σp̃c} = e^{−c}. NaN and infinite inputs read "no guarantee"; a token of zero mass changes
// nothing. (Split-KV merges: SplitKvMergeEqualsOnePass.)
TEST(Meter, MomentKnownAnswers) {
  for (double c : {1e-9, 0.01, 0.3, 2.0}) {
    MeterStats s;
    for (double z : {0.0, -1.0, 3.0, 2.5}) s.add_moment(z, c);
    EXPECT_GE(s.log_A(), c);
    EXPECT_NEAR(s.log_A(), c, 1e-12 * (1 + c));
    EXPECT_LE(s.log_A_minus(), -c);
    EXPECT_NEAR(s.log_A_minus(), -c, 1e-12 * (1 + c));
  }
  const auto no_guarantee = [](double log_A) { return std::isnan(log_A) || log_A == kInf; };
  MeterStats nan_c, inf_c, inf_z, zero_mass;
  for (MeterStats* s : {&nan_c, &inf_c, &inf_z, &zero_mass}) s->add_moment(0.0, 0.1);
  nan_c.add_moment(-1.0, NAN);
  inf_c.add_moment(-1.0, kInf);
  inf_z.add_moment(kInf, 0.1);
  zero_mass.add_moment(-kInf, kInf);
  EXPECT_TRUE(no_guarantee(nan_c.log_A()));
  EXPECT_TRUE(no_guarantee(inf_c.log_A()));
  EXPECT_TRUE(no_guarantee(inf_z.log_A()));
  MeterStats one;
  one.add_moment(0.0, 0.1);
  EXPECT_EQ(zero_mass.log_A(), one.log_A());
  EXPECT_EQ(zero_mass.log_A_minus(), one.log_A_minus());
}

TEST(Meter, LseKnownAnswers) {
  Lse l;
  EXPECT_EQ(l.value(), -kInf);
  l.add(0.0);
  l.add(0.0);
  EXPECT_NEAR(l.value(), std::log(2.0), 1e-15);
  l.add(1000.0);  // no overflow
  EXPECT_NEAR(l.value(), 1000.0, 1e-12);
  Lse big;
  big.add(kInf);
  EXPECT_EQ(big.value(), kInf);
  Lse nan;
  nan.add(NAN);
  EXPECT_TRUE(std::isnan(nan.value()));
  l.merge(nan);
  EXPECT_TRUE(std::isnan(l.value()));
}

TEST(Meter, ValueSideBound) {
  // ‖y − ŷ‖ ≤ 2·TV_K·max‖v‖ + Σ p̃ ρ^v, checked on a concrete pair of attention outputs.
  std::mt19937_64 rng(5);
  std::normal_distribution<double> n(0.0, 1.0);
  const int S = 64, d = 16;
  for (int trial = 0; trial < 1000; ++trial) {
    std::vector<double> z(S), eps(S), p(S), pt(S), v(S * d), vh(S * d);
    for (int t = 0; t < S; ++t) z[t] = 2.0 * n(rng), eps[t] = 0.3 * n(rng);
    double zs = 0.0, es = 0.0;
    for (int t = 0; t < S; ++t) zs += std::exp(z[t]), es += std::exp(z[t] - eps[t]);
    for (int t = 0; t < S; ++t) pt[t] = std::exp(z[t]) / zs, p[t] = std::exp(z[t] - eps[t]) / es;
    double vmax = 0.0, weighted_rho = 0.0;
    for (int t = 0; t < S; ++t) {
      double norm = 0.0, rho = 0.0;
      for (int i = 0; i < d; ++i) {
        v[t * d + i] = n(rng);
        vh[t * d + i] = v[t * d + i] + 0.05 * n(rng);
        norm += v[t * d + i] * v[t * d + i];
        rho += (vh[t * d + i] - v[t * d + i]) * (vh[t * d + i] - v[t * d + i]);
      }
      vmax = std::max(vmax, std::sqrt(norm));
      weighted_rho += pt[t] * std::sqrt(rho);
    }
    double err = 0.0;
    for (int i = 0; i < d; ++i) {
      double y = 0.0, yh = 0.0;
      for (int t = 0; t < S; ++t) y += p[t] * v[t * d + i], yh += pt[t] * vh[t * d + i];
      err += (y - yh) * (y - yh);
    }
    const double tv = true_tv(pt, eps);
    ASSERT_LE(std::sqrt(err), value_output_bound(tv, vmax, weighted_rho) * (1 + 1e-12));
  }
  EXPECT_EQ(value_meter(0.0, 0.0), 0.0);
  EXPECT_EQ(value_meter(1.0, 0.0), kInf);
  EXPECT_DOUBLE_EQ(value_meter(0.5, 4.0), 0.125);
}

// The true TV against 50-digit arithmetic, where p̃_t e^{−ε_t} needs no shift: subnormal p̃_t,
// |ε_t| near 700 of both signs (where a shift by max −ε_t alone loses the terms) and plain cases.
TEST(Meter, TrueTvKnownAnswers) {
  using Big = boost::multiprecision::cpp_dec_float_50;
  const auto reference = [](const std::vector<double>& p, const std::vector<double>& eps) {
    std::vector<Big> w(p.size());
    Big Z = 0;
    for (std::size_t t = 0; t < p.size(); ++t) Z += w[t] = Big(p[t]) * boost::multiprecision::exp(-Big(eps[t]));
    Big tv = 0;
    for (std::size_t t = 0; t < p.size(); ++t) tv += boost::multiprecision::abs(w[t] / Z - Big(p[t]));
    return static_cast<double>(tv / 2);
  };
  const double tiny = std::numeric_limits<double>::denorm_min();
  const std::vector<std::pair<std::vector<double>, std::vector<double>>> cases = {
      {{tiny, 1.0}, {-745.0, 0.0}},                    // p_0 ≈ 0.636: a shift by 745 underflows p̃_1's term
      {{tiny, 1.0}, {-700.0, 0.0}},                    // p_0 ≈ 5e-20
      {{1e-320, 1.0}, {-700.0, 40.0}},                 // p̃_1's term a subnormal of 7 bits under the old shift
      {{3 * tiny, 0.5, 0.5}, {-744.0, 700.0, 0.0}},    // three scales at once
      {{1e-310, 1.0}, {-20.0, 725.0}},                 // ε ≈ +700 on the heavy token
      {{0.25, 0.75}, {700.0, 699.0}},                  // both near +700
      {{0.25, 0.75}, {-700.0, -699.5}},                // both near −700
      {{0.0, 1.0}, {-1000.0, 0.0}},                    // p̃_t = 0 stays 0 whatever ε_t
      {{0.5, 0.5}, {0.1, -0.1}},                       // the counterexample
      {{0.2, 0.3, 0.5}, {0.01, -0.02, 0.3}},
      {{1e-300, 1.0 - 1e-9, 1e-9}, {-690.0, 1e-3, -5.0}},
  };
  for (const auto& [p, eps] : cases) {
    const double want = reference(p, eps), got = true_tv(p, eps);
    EXPECT_NEAR(got, want, 1e-12 * want + 1e-16) << "p̃ = (" << p[0] << ", " << p[1] << ", ...), ε = (" << eps[0]
                                                   << ", " << eps[1] << ", ...)";
  }
  EXPECT_NEAR(true_tv(std::vector<double>{tiny, 1.0}, std::vector<double>{-745.0, 0.0}), 0.636435898898410234, 1e-13);
}

// Fifty-digit references that stay accurate where their argument is far below 10^-50 of 1 (c_t
// subnormal): e^x − 1 and the shapes through it, never through 1 + x.
using Big = boost::multiprecision::cpp_bin_float_50;

Big expm1_big(const Big& x) { return abs(x) < Big(1e-20) ? x + x * x / 2 + x * x * x / 6 : Big(exp(x) - 1); }
Big tanh_big(const Big& x) { return abs(x) < Big(1e-20) ? x - x * x * x / 3 : Big(tanh(x)); }
Big sinh_big(const Big& x) { return abs(x) < Big(1e-20) ? x + x * x * x / 6 : Big(sinh(x)); }

// The shapes against 50-digit arithmetic at the edges of double: every c_t subnormal (tanh(c/2)
// once underflowed there to a meter of 0, below the true worst case), c_t large enough for exp to
// amplify its argument's rounding (30 to 710: the retention form once came out 8e-14 below its
// value), both in one cell, and logits far from 0. Each shape is at least its exact value and
// within its margins above it; a cell with some c_t > 0 never meters 0.
TEST(Meter, EdgesAgainstFiftyDigits) {
  const double tiny = std::numeric_limits<double>::denorm_min();
  struct Case {
    std::vector<double> w;  // probabilities, or logits when `logits`
    std::vector<double> c;
    bool logits = false;
  };
  const std::vector<Case> cases = {
      {{0.25, 0.75}, {tiny, tiny}},
      {{0.25, 0.75}, {tiny, 3 * tiny}},
      {{0.5, 0.25, 0.25}, {tiny, 0.0, 5 * tiny}},
      {{0.25, 0.75}, {1e-310, 1e-320}},
      {{0.5, 0.5}, {30.0, 0.0}},
      {{0.5, 0.5}, {300.0, 0.0}},
      {{0.5, 0.5}, {700.0, 0.0}},
      {{0.5, 0.5}, {710.0, 0.0}},
      {{0.5, 0.5}, {700.0, 700.0}},
      {{0.999, 0.001}, {0.0, 700.0}},
      {{0.001, 0.999}, {700.0, 30.0}},
      {{0.2, 0.3, 0.5}, {tiny, 700.0, 0.3}},
      {{0.5, 0.25, 0.25}, {1e-320, 30.0, 0.0}},
      {{0.25, 0.25, 0.5}, {300.0, tiny, 710.0}},
      {{1000.0, 999.5, 998.0}, {700.0, tiny, 0.1}, true},
      {{-700.0, 0.0, 3.0}, {30.0, 300.0, tiny}, true},
  };
  const char* names[] = {"eform", "two-sided", "retention", "tanh", "tanh-half"};
  for (const Case& k : cases) {
    const std::size_t n = k.w.size();
    std::vector<Big> p(n), c(k.c.begin(), k.c.end());
    Big total = 0;
    for (std::size_t t = 0; t < n; ++t) total += p[t] = k.logits ? Big(exp(Big(k.w[t]) - Big(k.w[0]))) : Big(k.w[t]);
    // a = A − 1 and am = 1 − A⁻ beside A⁻ itself, so that A² − 1, A/A⁻ − A⁻/A and the retention
    // terms keep their digits both when every c_t is subnormal and when A⁻ is e^-700.
    Big a = 0, am = 0, Am = 0, c_max = 0;
    for (std::size_t t = 0; t < n; ++t) {
      p[t] /= total;
      a += p[t] * expm1_big(c[t]);
      am -= p[t] * expm1_big(-c[t]);
      Am += p[t] * exp(-c[t]);
      c_max = std::max(c_max, c[t]);
    }
    Big retention = 0;
    for (std::size_t t = 0; t < n; ++t) {
      const Big e = expm1_big(c[t]), em = expm1_big(-c[t]);
      retention += p[t] * std::min<Big>(a + e + a * e, std::max<Big>((e + am) / Am, (a - em) / (1 + a)));
    }
    const std::array<Big, 5> want = {a * (a + 2) / 2, (a + am) * (1 + a + Am) / (2 * (1 + a) * Am), retention / 2,
                                     tanh_big(c_max), tanh_big(c_max / 2)};
    const Bounds b = k.logits ? evaluate_logits(k.w, k.c) : evaluate(k.w, k.c);
    const std::array<double, 5> got = {b.eform, b.two_sided, b.retention, b.tanh, b.tanh_half};
    for (int s = 0; s < 5; ++s) {
      SCOPED_TRACE(std::string(names[s]) + " at c = " + ::testing::PrintToString(k.c));
      EXPECT_GE(Big(got[s]), want[s]) << got[s] << " below " << want[s];
      // Where the value nears the double range a shape may overflow early to +inf (no guarantee);
      // elsewhere it is within its margins: an absolute one in log A (about 1e-15 here) for the
      // log-domain shapes, one subnormal ulp for the tanh shapes.
      if (got[s] == kInf) {
        EXPECT_GT(want[s], Big(1e300));
      } else {
        EXPECT_LE(Big(got[s]), want[s] * Big(1 + 1e-9) + Big(s < 3 ? 1e-12 : 2 * tiny)) << got[s] << " vs " << want[s];
      }
    }
    EXPECT_GT(b.meter(), 0.0);
    EXPECT_GE(Big(b.meter()), std::min(Big(1), *std::min_element(want.begin(), want.end())));
  }
}

// The shapes' functions near the subnormal range, where a relative margin rounds away: never below
// their exact values, and zero only at zero.
TEST(Meter, ShapeFunctionsNeverUnderflowBelowTheirValue) {
  const double tiny = std::numeric_limits<double>::denorm_min();
  for (double x : {tiny, 2 * tiny, 3 * tiny, 5 * tiny, 1e-320, 1e-310, 0x1p-1000, std::nextafter(0x1p-1000, 0.0), 0x1p-999,
                   1e-300, 0x1p-60, 1e-9, 0.3, 30.0}) {
    SCOPED_TRACE(x);
    const Big bx = x;
    const std::array<std::pair<double, Big>, 4> pairs = {{{eform_raw(x), expm1_big(2 * bx) / 2},
                                                          {two_sided_raw(x, -x), sinh_big(2 * bx)},
                                                          {tanh_shape(x), tanh_big(bx)},
                                                          {tanh_half_shape(x), tanh_big(bx / 2)}}};
    for (const auto& [got, want] : pairs) {
      EXPECT_GT(got, 0.0);
      EXPECT_GE(Big(got), want);
      EXPECT_LE(Big(got), want * Big(1 + 1e-11) + Big(2 * tiny));
    }
  }
  EXPECT_EQ(eform_raw(0.0), 0.0);
  EXPECT_EQ(two_sided_raw(0.0, 0.0), 0.0);
  EXPECT_EQ(tanh_shape(0.0), 0.0);
  EXPECT_EQ(tanh_half_shape(0.0), 0.0);
}
}  // namespace
}  // namespace witcert::cert
