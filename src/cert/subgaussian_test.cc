#include "cert/subgaussian.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

namespace witcert::cert {
namespace {

TEST(SubGaussian, DeltaAllocation) {
  EXPECT_DOUBLE_EQ(delta_loc(0.01, 30, 9, 256), 0.01 / 69120.0);
  EXPECT_DOUBLE_EQ(delta_loc(0.5, 1, 1, 1), 0.5);
  for (double bad : {0.0, 1.0, -0.1, 1.5, std::numeric_limits<double>::quiet_NaN()})
    EXPECT_THROW(delta_loc(bad, 1, 1, 1), std::invalid_argument) << bad;
  EXPECT_THROW(delta_loc(0.01, 0, 1, 1), std::invalid_argument);
  EXPECT_THROW(delta_loc(0.01, 1, 0, 1), std::invalid_argument);
  EXPECT_THROW(delta_loc(0.01, 1, 1, 0), std::invalid_argument);
}

TEST(SubGaussian, VarianceProxyKnownAnswer) {
  // d = 4, two groups of 2: scales 1 and 0.5; q = (1, 2, 3, 4), channel 3 an outlier.
  // ς² = (sm²/12)(1·1 + 4·1 + 9·0.25) = (1/4)/12 · 7.25 with sm = 1/2.
  const std::vector<float> q = {1, 2, 3, 4};
  const std::vector<f16> s = {0x3C00, 0x3800};
  const std::vector<std::uint8_t> outlier = {0, 0, 0, 1};
  const double v = dither_variance_proxy(q, s, outlier, 2, 0.5);
  EXPECT_NEAR(v, 7.25 / 48.0, 1e-11 * 7.25 / 48.0);
  EXPECT_GE(v, 7.25 / 48.0) << "rounded up, never down";
  const std::vector<f16> s_inf = {0x3C00, kFp16PosInf};
  EXPECT_EQ(dither_variance_proxy(q, s_inf, outlier, 2, 0.5), INFINITY);
}

TEST(SubGaussian, RadiusKnownAnswerAndMonotone) {
  // ς² = 1, S = 1, δ = 2/e²: log(2S/δ) = 2, so the tail term is sqrt(2·2) = 2.
  const double u = subgaussian_radius(1.0, 1, 2.0 / std::exp(2.0), 0);
  EXPECT_NEAR(u, 2.0, 1e-11);
  EXPECT_GE(u, 2.0);
  EXPECT_LT(subgaussian_radius(1.0, 100, 1e-3, 64), subgaussian_radius(1.0, 100, 1e-6, 64));
  EXPECT_LT(subgaussian_radius(1.0, 100, 1e-3, 64), subgaussian_radius(1.0, 1000, 1e-3, 64));
  EXPECT_EQ(subgaussian_radius(INFINITY, 100, 1e-3, 64), INFINITY);
  EXPECT_EQ(subgaussian_radius(0.0, 100, 1e-3, 64), 0.0);
  // A δ_loc so small that 2S/δ_loc overflows a double still gives the finite radius:
  // S = 2^20, δ_loc = 2^-1070 (subnormal): log(2S/δ) = 1091·log 2.
  const double tiny = subgaussian_radius(1.0, 1L << 20, 0x1p-1070, 0);
  EXPECT_TRUE(std::isfinite(tiny));
  EXPECT_NEAR(tiny, std::sqrt(2.0 * 1091.0 * std::log(2.0)), 1e-9);
  EXPECT_GE(tiny, std::sqrt(2.0 * 1091.0 * std::log(2.0)));
  EXPECT_EQ(subgaussian_radius(1.0, 100, 0.0, 64), INFINITY);  // no budget: no guarantee
}

}  // namespace
}  // namespace witcert::cert
