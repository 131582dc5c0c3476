#include "base/fp16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

namespace witcert {
namespace {

TEST(Fp16, KnownAnswers) {
  EXPECT_EQ(fp16_from_double(0.0), 0x0000);
  EXPECT_EQ(fp16_from_double(-0.0), 0x8000);
  EXPECT_EQ(fp16_from_double(1.0), 0x3C00);
  EXPECT_EQ(fp16_from_double(-2.0), 0xC000);
  EXPECT_EQ(fp16_from_double(0.5), 0x3800);
  EXPECT_EQ(fp16_from_double(65504.0), 0x7BFF);
  EXPECT_EQ(fp16_from_double(65519.99), 0x7BFF);
  EXPECT_EQ(fp16_from_double(65520.0), 0x7C00);  // the tie rounds to even: +inf
  EXPECT_EQ(fp16_from_double(std::ldexp(1.0, -24)), 0x0001);
  EXPECT_EQ(fp16_from_double(std::ldexp(1.0, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(fp16_from_double(std::ldexp(1.0, -26)), 0x0000);  // below half the smallest subnormal
  EXPECT_EQ(fp16_from_double(1.0 + std::ldexp(1.0, -11)), 0x3C00);  // tie to even
  EXPECT_EQ(fp16_from_double(1.0 + 3 * std::ldexp(1.0, -11)), 0x3C02);  // tie to even, upward
  EXPECT_EQ(fp16_from_double(INFINITY), 0x7C00);
  EXPECT_EQ(fp16_from_double(-INFINITY), 0xFC00);
  EXPECT_TRUE(std::isnan(fp16_to_double(fp16_from_double(NAN))));
  EXPECT_EQ(fp16_to_double(0x3555), 0.333251953125);
  EXPECT_EQ(fp16_to_double(0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(fp16_to_double(0x7BFF), 65504.0);
}

TEST(Fp16, RoundUpKnownAnswers) {
  EXPECT_EQ(fp16_from_double(1.0, Round::up), 0x3C00);
  EXPECT_EQ(fp16_from_double(1.0000001, Round::up), 0x3C01);
  EXPECT_EQ(fp16_from_double(-1.0000001, Round::up), 0xBC00);
  EXPECT_EQ(fp16_from_double(1e-12, Round::up), 0x0001);
  EXPECT_EQ(fp16_from_double(-1e-12, Round::up), 0x8000);
  EXPECT_EQ(fp16_from_double(65504.001, Round::up), 0x7C00);
  EXPECT_EQ(fp16_from_double(-70000.0, Round::up), 0xFBFF);
  EXPECT_EQ(fp16_next_up(0x8000), 0x0001);
  EXPECT_EQ(fp16_next_up(0x7BFF), 0x7C00);
  EXPECT_EQ(fp16_next_up(0x7C00), 0x7C00);
  EXPECT_EQ(fp16_next_up(0xFC00), 0xFBFF);
}

TEST(Fp16, EveryValueRoundTrips) {
  for (int h = 0; h < 65536; ++h) {
    const double v = fp16_to_double(static_cast<f16>(h));
    if (std::isnan(v)) continue;
    ASSERT_EQ(fp16_from_double(v), h) << std::hex << h;
    ASSERT_EQ(fp16_from_double(v, Round::up), h) << std::hex << h;
    ASSERT_EQ(fp16_from_double_reference(v), h) << std::hex << h;
    ASSERT_EQ(fp16_from_double_reference(v, Round::up), h) << std::hex << h;
  }
}

TEST(Fp16, FastFloatPathsMatchTheReference) {
  for (int h = 0; h < 65536; ++h) {
    const double v = fp16_to_double(static_cast<f16>(h));
    const float f = fp16_to_float(static_cast<f16>(h));
    if (std::isnan(v)) {
      ASSERT_TRUE(std::isnan(f));
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), v) << std::hex << h;
    ASSERT_EQ(std::signbit(f), std::signbit(v)) << std::hex << h;
    ASSERT_EQ(fp16_from_float(f), h) << std::hex << h;
  }
  // Every float between consecutive fp16 values, ties included, against the double reference.
  std::mt19937 rng(17);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 2000000; ++i) {
    std::uint32_t b = bits(rng);
    if (i % 4 == 0) b = (b & 0x8000'0000u) | (0x3300'0000u + b % 0x1500'0000u);  // fp16 range
    if (i % 8 == 1) b = (b & 0xFFFF'E000u) | 0x1000u;  // exact ties between two fp16 values
    float f;
    std::memcpy(&f, &b, 4);
    const f16 want = fp16_from_double_reference(static_cast<double>(f));
    ASSERT_EQ(fp16_from_double(static_cast<double>(f)), want) << f;
    ASSERT_EQ(fp16_from_double(static_cast<double>(f), Round::up), fp16_from_double_reference(f, Round::up)) << f;
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(fp16_to_double(fp16_from_float(f))));
      continue;
    }
    ASSERT_EQ(fp16_from_float(f), want) << f;
  }
}

TEST(Fp16, RoundUpIsTheLeastUpperFp16) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> mant(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-30, 17);
  for (int i = 0; i < 200000; ++i) {
    const double v = std::ldexp(mant(rng), expo(rng));
    const f16 up = fp16_from_double(v, Round::up);
    const double u = fp16_to_double(up);
    ASSERT_GE(u, v);
    // The fp16 value just below `up` must lie below v.
    f16 below = up;
    if (up == 0x0000) below = 0x8001;
    else if (up & 0x8000) below = static_cast<f16>(up + 1);
    else below = static_cast<f16>(up - 1);
    ASSERT_LT(fp16_to_double(below), v) << v;
    // Nearest is within half a spacing: |r − v| ≤ |r' − v| for both neighbours r'.
    if (std::fabs(v) >= 65520.0) continue;  // overflows to ±inf under round-to-nearest
    ASSERT_EQ(up, fp16_from_double_reference(v, Round::up)) << v;
    const f16 n = fp16_from_double(v);
    ASSERT_EQ(n, fp16_from_double_reference(v)) << v;
    const double r = fp16_to_double(n);
    ASSERT_LE(std::fabs(r - v), std::fabs(fp16_to_double(fp16_next_up(n)) - v));
  }
}

}  // namespace
}  // namespace witcert
