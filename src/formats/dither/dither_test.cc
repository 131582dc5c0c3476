#include "formats/dither/dither.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <string>
#include <stdexcept>
#include <vector>

namespace witcert::formats {
namespace {

struct Encoded {
  std::vector<std::int8_t> codes;
  std::vector<f16> scales, outliers;
};

Encoded encode(const std::vector<float>& x, const std::vector<float>& xi, const std::vector<std::uint8_t>& mask,
               int group, int bits = 8) {
  Encoded e;
  e.codes.resize(x.size());
  e.scales.resize(x.size() / group);
  e.outliers.resize(std::count(mask.begin(), mask.end(), 1));
  encode_dither(bits, x, xi, mask, group, e.codes, e.scales, e.outliers);
  return e;
}

// Keys with a massive-activation channel, as real models have.
std::vector<float> draw_key(std::mt19937_64& rng, int d) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(d);
  for (float& v : x) v = n(rng) * std::exp(n(rng));
  x[3] *= 50.0f;
  for (float& v : x) v = static_cast<float>(fp16_to_double(fp16_from_double(v)));
  return x;
}

// Every width: the codes stay in [−Q, Q] (no clipping) and the reconstruction is within s/2.
TEST(Dither, NoClippingAndErrorWithinHalfStepExactlyAtEveryWidth) {
  std::mt19937_64 rng(1);
  const int d = 128, G = 32;
  std::vector<std::uint8_t> mask(d, 0);
  mask[3] = mask[67] = 1;  // the RoPE pair (3, 67) of a NeoX-layout head
  std::vector<float> xi(d), out(d);
  for (int bits : kDitherBits) {
    const int q = dither_max_code(bits);
    const std::uint32_t slots = bits == 8 ? 20000 : 8000;
    long elements = 0, at_q = 0;
    for (std::uint32_t slot = 0; slot < slots; ++slot) {
      const std::vector<float> x = draw_key(rng, d);
      dither_values({5, 1, 2}, slot, xi);
      const Encoded e = encode(x, xi, mask, G, bits);
      decode_dither(e.codes, e.scales, xi, mask, e.outliers, G, out);
      for (int c = 0; c < d; ++c) {
        if (mask[c]) {
          ASSERT_EQ(out[c], x[c]) << "outlier channels are stored exactly";
          continue;
        }
        const double s = fp16_to_double(e.scales[c / G]);
        ASSERT_LE(std::fabs(x[c] / s), q - 0.5) << "|x/s| ≤ Q − ½ with the stored scale";
        ASSERT_GE(e.codes[c], -q) << bits << " bits";
        ASSERT_LE(e.codes[c], q) << bits << " bits";
        at_q += std::abs(e.codes[c]) == q;
        // The exact (double) reconstruction error is within s/2 with no slack.
        const double exact = s * (double(e.codes[c]) - double(xi[c]));
        ASSERT_LE(std::fabs(exact - double(x[c])), s / 2) << bits << " bits, slot " << slot << " channel " << c;
        // The float decode adds at most half a float ulp of the decoded value (covered by β_t).
        ASSERT_LE(std::fabs(double(out[c]) - exact), std::fabs(exact) * 0x1p-24);
        ++elements;
      }
    }
    EXPECT_EQ(elements, long{slots} * (d - 2));
    EXPECT_GT(at_q, 0) << bits << " bits: the amax reaches the largest code";
  }
}

TEST(DitherInt8, ScaleIsStoredRoundedUpAndOutliersLeaveTheAmax) {
  const int d = 64, G = 32;
  std::vector<float> x(d, 0.0f), xi(d, 0.0f);
  for (int c = 0; c < d; ++c) x[c] = 0.25f * static_cast<float>(c % 7) - 0.5f;
  x[10] = 1000.0f;  // an outlier channel far above the rest of its group
  std::vector<std::uint8_t> mask(d, 0);
  mask[10] = 1;
  const Encoded e = encode(x, xi, mask, G);
  // Group 0's amax without channel 10 is 1.0: s = fp16_up(1/126.5).
  EXPECT_EQ(e.scales[0], fp16_from_double(1.0 / 126.5, Round::up));
  EXPECT_GE(fp16_to_double(e.scales[0]), 1.0 / 126.5);
  EXPECT_EQ(e.outliers.size(), 1u);
  EXPECT_EQ(fp16_to_double(e.outliers[0]), 1000.0);
  // Without the mask the outlier drags the scale up by three orders of magnitude.
  const Encoded plain = encode(x, xi, std::vector<std::uint8_t>(d, 0), G);
  EXPECT_GT(fp16_to_double(plain.scales[0]), 500 * fp16_to_double(e.scales[0]));
}

TEST(DitherInt8, KnownAnswer) {
  // x = (1, −0.5), group of 2, ξ = (0.25, −0.25): s = fp16_up(1/126.5) = (1 + 13/1024)·2^-7.
  const std::vector<float> x = {1.0f, -0.5f}, xi = {0.25f, -0.25f};
  const std::vector<std::uint8_t> mask = {0, 0};
  const Encoded e = encode(x, xi, mask, 2);
  const double s = fp16_to_double(e.scales[0]);
  EXPECT_EQ(e.scales[0], 0x200D);
  EXPECT_EQ(s, (1.0 + 13.0 / 1024.0) / 128.0);
  EXPECT_EQ(e.codes[0], 127);  // round(126.3955… + 0.25)
  EXPECT_EQ(e.codes[1], -63);  // round(−63.198… − 0.25) = −63
}

TEST(Dither, KnownAnswerAtFourBits) {
  // Q = 7: s = fp16_up(1/6.5) = (1 + 237/1024)·2^-3; codes round(6.4965… + 0.25) = 7 and
  // round(−3.2483… − 0.25) = −3.
  const std::vector<float> x = {1.0f, -0.5f}, xi = {0.25f, -0.25f};
  const Encoded e = encode(x, xi, {0, 0}, 2, 4);
  EXPECT_EQ(e.scales[0], 0x30ED);
  EXPECT_EQ(fp16_to_double(e.scales[0]), (1.0 + 237.0 / 1024.0) / 8.0);
  EXPECT_EQ(e.codes[0], 7);
  EXPECT_EQ(e.codes[1], -3);
  EXPECT_EQ(dither_scale_divisor(5), 14.5);
  EXPECT_EQ(dither_scale_divisor(6), 30.5);
  EXPECT_EQ(dither_scale_divisor(8), 126.5);
}

TEST(DitherInt8, ZeroAndNonFiniteGroups) {
  const int d = 8, G = 4;
  std::vector<float> x(d, 0.0f), xi(d, 0.3f), out(d);
  x[5] = NAN;
  const std::vector<std::uint8_t> mask(d, 0);
  const Encoded e = encode(x, xi, mask, G);
  EXPECT_EQ(e.scales[0], 0);  // an all-zero group is exact
  EXPECT_EQ(e.scales[1], kFp16PosInf) << "a NaN group must be marked, never encoded as a number";
  decode_dither(e.codes, e.scales, xi, mask, e.outliers, G, out);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(out[c], 0.0f);
  for (int c = 4; c < 8; ++c) EXPECT_FALSE(std::isfinite(out[c]));
}

// Channel scales over a block: channel c's scale is amax over the block's tokens of |x_{t,c}|,
// rounded up as a token group's is; outlier channels get none and a non-finite channel +inf. The
// known answer: channel 0 holds 1 and −0.5 over two tokens, as the group of DitherInt8.KnownAnswer.
TEST(Dither, ChannelScalesKnownAnswerZeroAndNonFinite) {
  const int d = 4, n = 2;
  const std::vector<float> x = {1.0f, 0.0f, 3.0f, 2.0f,   // token 0
                                -0.5f, 0.0f, -8.0f, NAN};  // token 1
  const std::vector<std::uint8_t> mask = {0, 0, 1, 0};
  std::vector<f16> scales(d, 0x1234);
  dither_channel_scales(8, x, n, mask, scales);
  EXPECT_EQ(scales[0], 0x200D);  // fp16_up(1/126.5)
  EXPECT_EQ(scales[1], 0);       // an all-zero channel is exact
  EXPECT_EQ(scales[2], 0);       // an outlier channel: its values are kept in fp16, 8 is not in any amax
  EXPECT_EQ(scales[3], kFp16PosInf) << "a NaN channel must be marked, never encoded as a number";
  std::vector<std::int8_t> codes(d);
  std::vector<f16> outliers(1);
  std::vector<float> out(d);
  const std::vector<float> xi = {-0.25f, 0.4f, 0.0f, 0.1f};
  encode_dither_scaled(std::span<const float>(&x[d], d), xi, mask, scales, 1, codes, outliers);
  EXPECT_EQ(codes[0], -63);  // round(−63.198… − 0.25)
  EXPECT_EQ(codes[1], 0);
  EXPECT_EQ(outliers[0], fp16_from_float(-8.0f));
  EXPECT_EQ(codes[3], 0);
  decode_dither(codes, scales, xi, mask, outliers, 1, out);
  EXPECT_EQ(out[2], -8.0f);
  EXPECT_FALSE(std::isfinite(out[3]));
  EXPECT_EQ(scale_granularity_name(parse_scale_granularity("channel")), std::string("channel"));
  EXPECT_EQ(parse_scale_granularity("token"), ScaleGranularity::token);
  EXPECT_THROW(parse_scale_granularity("block"), std::invalid_argument);
}

// At every width, every token of a block encoded against the block's channel scales has codes
// within ±Q and decodes within s_c/2 of its fp16 value, for channels of very different ranges.
TEST(Dither, ChannelScalesCoverEveryTokenOfTheBlockAtEveryWidth) {
  const int d = 64, n = 37;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<float> x(static_cast<std::size_t>(n) * d), xi(d), out(d);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) x[t * d + c] = g(rng) * std::ldexp(1.0f, c % 9 - 4) * (t == 17 && c == 3 ? 50.0f : 1.0f);
  std::vector<std::uint8_t> mask(d, 0);
  mask[10] = mask[11] = 1;
  for (int bits : kDitherBits) {
    std::vector<f16> scales(d);
    dither_channel_scales(bits, x, n, mask, scales);
    std::vector<std::int8_t> codes(d);
    std::vector<f16> outliers(2);
    for (int t = 0; t < n; ++t) {
      for (float& v : xi) v = u(rng);
      const std::span<const float> row(&x[t * d], d);
      encode_dither_scaled(row, xi, mask, scales, 1, codes, outliers);
      decode_dither(codes, scales, xi, mask, outliers, 1, out);
      for (int c = 0; c < d; ++c) {
        const double exact = fp16_to_double(fp16_from_float(row[c]));
        if (mask[c]) {
          EXPECT_EQ(out[c], exact);
          continue;
        }
        EXPECT_LE(std::abs(codes[c]), dither_max_code(bits)) << bits << " " << t << " " << c;
        EXPECT_LE(std::fabs(out[c] - exact), fp16_to_double(scales[c]) * (0.5 + 0x1p-17)) << bits << " " << t << " " << c;
      }
    }
  }
}

TEST(DitherInt8, GroupMustDivideHeadDim) {
  EXPECT_NO_THROW(check_group(64, 32));
  EXPECT_THROW(check_group(64, 24), std::invalid_argument);
  EXPECT_THROW(check_group(64, 0), std::invalid_argument);
}

// The residual x̂ − x of subtractive dither is uniform on [−s/2, s/2) whatever x is:
// a Kolmogorov–Smirnov test on a fixed input over many dither draws. The same test rejects
// plain rounding (no dither), whose residual for a fixed input is a point mass.
double ks_statistic(std::vector<double> u) {  // u should be U[0, 1)
  std::sort(u.begin(), u.end());
  const double n = static_cast<double>(u.size());
  double D = 0.0;
  for (std::size_t i = 0; i < u.size(); ++i)
    D = std::max({D, (i + 1) / n - u[i], u[i] - i / n});
  return D;
}

class DitherResidual : public ::testing::TestWithParam<int> {};

TEST_P(DitherResidual, IsUniformGoodnessOfFit) {
  const int d = 32, G = 32, n = 4000;
  std::mt19937_64 rng(8);
  const std::vector<float> x = draw_key(rng, d);
  const std::vector<std::uint8_t> mask(d, 0);
  std::vector<std::vector<double>> residual(d), rtn(d);
  std::vector<float> xi(d);
  const std::vector<float> no_dither(d, 0.0f);
  const int bits = GetParam();
  for (std::uint32_t slot = 0; slot < n; ++slot) {
    dither_values({77, 0, 0}, slot, xi);
    const Encoded e = encode(x, xi, mask, G, bits);
    const Encoded r = encode(x, no_dither, mask, G, bits);
    const double s = fp16_to_double(e.scales[0]);
    for (int c = 0; c < d; ++c) {
      residual[c].push_back((s * (e.codes[c] - double(xi[c])) - x[c]) / s + 0.5);
      rtn[c].push_back((s * double(r.codes[c]) - x[c]) / s + 0.5);
    }
  }
  // Critical value of the one-sample KS statistic at α = 1e-4 (per channel, 32 channels):
  // sqrt(−ln(α/2)/2)/sqrt(n).
  const double critical = std::sqrt(-std::log(0.5e-4) / 2.0) / std::sqrt(double(n));
  int rtn_rejected = 0;
  for (int c = 0; c < d; ++c) {
    EXPECT_LT(ks_statistic(residual[c]), critical) << "channel " << c;
    rtn_rejected += ks_statistic(rtn[c]) > critical;
  }
  EXPECT_EQ(rtn_rejected, d) << "the test must reject undithered rounding";
}

INSTANTIATE_TEST_SUITE_P(EveryWidth, DitherResidual, ::testing::ValuesIn(kDitherBits));

}  // namespace
}  // namespace witcert::formats
