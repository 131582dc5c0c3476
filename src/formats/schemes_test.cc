#include "formats/schemes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/alloc_counter.h"
#include "base/fp16.h"
#include "formats/fp8/fp8.h"
#include "formats/ggml/ggml_types.h"
#include "formats/rotation/hadamard.h"

namespace witcert::formats {
namespace {

using Bytes = std::vector<std::uint8_t>;

Bytes encode(const KvScheme& s, const std::vector<float>& x, int d) {
  Bytes b(s.block_bytes(d));
  s.encode(x.data(), d, b.data());
  return b;
}

std::vector<float> decode(const KvScheme& s, const Bytes& b, int d) {
  std::vector<float> y(static_cast<std::size_t>(s.tokens_per_block()) * d);
  s.decode(b.data(), d, y.data());
  return y;
}

std::vector<float> round_trip(const KvScheme& s, const std::vector<float>& x, int d) {
  return decode(s, encode(s, x, d), d);
}

double fp16_up(double v) { return fp16_to_double(fp16_from_double(v, Round::up)); }
double fp16_down(double v) { return -fp16_up(-v); }
float as_fp16(double v) { return fp16_to_float(fp16_from_double(v)); }

// T tokens of d fp16 values: heavy-tailed, with a massive-activation channel as real keys have.
std::vector<float> draw_block(std::mt19937_64& rng, int T, int d) {
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<float> x(static_cast<std::size_t>(T) * d);
  for (std::size_t i = 0; i < x.size(); ++i) {
    double v = n(rng) * std::exp(n(rng));
    if (i % d == 3) v *= 50.0;
    x[i] = as_fp16(v);
  }
  return x;
}

// ---- FP8 E4M3FN

TEST(SchemeFp8, KnownEncodings) {
  struct Case {
    double v;
    std::uint8_t bits;
    const char* why;
  };
  const Case cases[] = {
      {1.0, 0x38, "0.0111.000"},
      {-2.0, 0xC0, "1.1000.000"},
      {448.0, 0x7E, "the largest finite value, 1.75·2^8"},
      {-448.0, 0xFE, "its negative"},
      {464.0, 0x7E, "saturated (halfway to the would-be 480)"},
      {1e6, 0x7E, "saturated"},
      {-65504.0, 0xFE, "fp16's lowest, saturated"},
      {0x1p-9, 0x01, "the smallest subnormal"},
      {0x1p-6, 0x08, "the smallest normal"},
      {0.0, 0x00, "zero"},
      {-0.0, 0x80, "negative zero"},
      {240.0, 0x77, "1.875·2^7"},
      {1.0625, 0x38, "tie between 1 (mantissa 0) and 1.125 (mantissa 1): even, down"},
      {1.1875, 0x3A, "tie between 1.125 (mantissa 1) and 1.25 (mantissa 2): even, up"},
      {15.5, 0x58, "tie between 15 (mantissa 7) and 16: even, carries into the next binade"},
      {1.5 * 0x1p-9, 0x02, "subnormal tie between 1 and 2 units of 2^-9: even, up"},
      {0x1p-10, 0x00, "tie between 0 and 2^-9: even, to zero"},
      {0x1.8p-10, 0x01, "above half a subnormal unit: up"},
      {-0x1p-11, 0x80, "underflow keeps the sign"},
      {NAN, 0x7F, "NaN"},
      {INFINITY, 0x7F, "no infinity in E4M3FN: NaN, never a finite value"},
      {-INFINITY, 0x7F, "no infinity in E4M3FN: NaN, never a finite value"},
  };
  for (const Case& c : cases) EXPECT_EQ(fp8_e4m3_from_double(c.v), c.bits) << c.v << ": " << c.why;
}

TEST(SchemeFp8, DecodesEveryCodeAndRoundsToTheNearest) {
  EXPECT_EQ(fp8_e4m3_to_double(0x7E), 448.0);
  EXPECT_EQ(fp8_e4m3_to_double(0x01), 0x1p-9);
  EXPECT_EQ(fp8_e4m3_to_double(0x08), 0x1p-6);
  EXPECT_EQ(fp8_e4m3_to_double(0xB8), -1.0);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_double(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_double(0xFF)));
  std::vector<double> finite;
  for (int b = 0; b < 256; ++b) {
    const double v = fp8_e4m3_to_double(static_cast<std::uint8_t>(b));
    if (std::isnan(v)) continue;
    finite.push_back(v);
    EXPECT_EQ(fp8_e4m3_from_double(v), b) << "every finite code encodes to itself";
  }
  EXPECT_EQ(finite.size(), 254u);
  // The read path's table holds the reference decode of every pattern, NaN where it is NaN.
  const float* table = fp8_e4m3_float_table();
  for (int b = 0; b < 256; ++b) {
    const double v = fp8_e4m3_to_double(static_cast<std::uint8_t>(b));
    if (std::isnan(v))
      EXPECT_TRUE(std::isnan(table[b])) << b;
    else
      EXPECT_EQ(static_cast<double>(table[b]), v) << b;
  }
  // Against brute force over all codes: the encoding is a nearest value, within 2^-4 relative
  // error for normals (3 mantissa bits) and 2^-10 absolute for subnormals.
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> log2mag(-12.0, 8.8);
  for (int i = 0; i < 200000; ++i) {
    const double v = (i % 2 ? -1.0 : 1.0) * std::exp2(log2mag(rng));
    const double got = fp8_e4m3_to_double(fp8_e4m3_from_double(v));
    double best = INFINITY;
    for (double f : finite) best = std::min(best, std::fabs(f - v));
    ASSERT_EQ(std::fabs(got - v), best) << v;
    ASSERT_LE(std::fabs(got - v), std::max(std::fabs(v) * 0x1p-4, 0x1p-10)) << v;
  }
}

TEST(SchemeFp8, ScaledKnownAnswer) {
  const KvScheme& s = kv_scheme("fp8-e4m3-scaled");
  // amax = 448: s = 1 and the codes are the raw casts.
  EXPECT_EQ(encode(s, {448.0f, -224.0f, 1.0f, 0.0f}, 4), (Bytes{0x00, 0x3C, 0x7E, 0xF6, 0x38, 0x00}));
  // amax = 1: s = the least fp16 ≥ 1/448 = 1171·2^-19 (0x1893); 1/s = 447.7 → 448 (0x7E),
  // 0.5/s = 223.9 → 224 (0x76, spacing 16 in [128, 256)).
  const std::vector<float> x = {1.0f, 0.5f, 0.0f, -0.0f};
  EXPECT_EQ(encode(s, x, 4), (Bytes{0x93, 0x18, 0x7E, 0x76, 0x00, 0x80}));
  const double step = 1171 * 0x1p-19;
  EXPECT_EQ(round_trip(s, x, 4), (std::vector<float>{float(448 * step), float(224 * step), 0.0f, 0.0f}));
}

// ---- Packed RTN records, hand-built

TEST(SchemePacking, RtnInt8KnownAnswer) {
  const KvScheme& s = kv_scheme("rtn-int8");
  std::vector<float> x(64, 0.0f);
  // Group 0: amax 127, so s = 1; codes round half to even; stored offset binary (q + 128).
  const float g0[] = {127.0f, -63.5f, 0.5f, 1.5f, 2.5f, -127.0f};
  std::copy(std::begin(g0), std::end(g0), x.begin());
  // Group 1: amax 1, s = the least fp16 ≥ 1/127 = 1033·2^-17 (0x2009, spacing 2^-17 above 2^-7);
  // 1/s = 126.89 → 127 (no clipping), −0.25/s = −31.72 → −32.
  x[32] = 1.0f;
  x[33] = -0.25f;
  Bytes want(68, 0x80);
  const std::uint8_t head0[] = {0x00, 0x3C, 0xFF, 0x40, 0x80, 0x82, 0x82, 0x01};
  std::copy(std::begin(head0), std::end(head0), want.begin());
  const std::uint8_t head1[] = {0x09, 0x20, 0xFF, 0x60};
  std::copy(std::begin(head1), std::end(head1), want.begin() + 34);
  EXPECT_EQ(encode(s, x, 64), want);
  std::vector<float> y(64, 0.0f);
  const float y0[] = {127.0f, -64.0f, 0.0f, 2.0f, 2.0f, -127.0f};
  std::copy(std::begin(y0), std::end(y0), y.begin());
  y[32] = float(127 * 1033 * 0x1p-17);
  y[33] = float(-32 * 1033 * 0x1p-17);
  EXPECT_EQ(round_trip(s, x, 64), y);
}

TEST(SchemePacking, RtnInt4KnownAnswer) {
  const KvScheme& s = kv_scheme("rtn-int4");
  std::vector<float> x(32, 0.0f);
  x[0] = 7.0f;   // amax 7: s = 1; q = 7 → nibble 15
  x[1] = -3.5f;  // q = −4 (half to even) → nibble 4
  x[2] = 1.0f;   // nibble 9; zeros → nibble 8
  Bytes want(18, 0x88);
  want[0] = 0x00;
  want[1] = 0x3C;
  want[2] = 0x4F;  // channel 0 in the low nibble, channel 1 in the high one
  want[3] = 0x89;
  EXPECT_EQ(encode(s, x, 32), want);
  std::vector<float> y(32, 0.0f);
  y[0] = 7.0f;
  y[1] = -4.0f;
  y[2] = 1.0f;
  EXPECT_EQ(round_trip(s, x, 32), y);
}

TEST(SchemePacking, Rtn2bitKnownAnswer) {
  const KvScheme& s = kv_scheme("rtn-2bit");
  std::vector<float> x(32, 0.0f);
  x[0] = -1.0f;  // lo = −1, s = (2 − (−1))/3 = 1
  x[2] = 0.5f;   // (0.5 + 1)/1 = 1.5 → 2 (half to even)
  x[3] = 2.0f;
  Bytes want(12, 0x55);                                        // zeros: code 1 in every 2-bit field
  const std::uint8_t head[] = {0x00, 0x3C, 0x00, 0xBC, 0xE4};  // fields 0, 1, 2, 3 from the low bits up
  std::copy(std::begin(head), std::end(head), want.begin());
  EXPECT_EQ(encode(s, x, 32), want);
  std::vector<float> y(32, 0.0f);
  y[0] = -1.0f;
  y[2] = 1.0f;
  y[3] = 2.0f;
  EXPECT_EQ(round_trip(s, x, 32), y);
}

TEST(SchemePacking, Sign1bitKnownAnswer) {
  const KvScheme& s = kv_scheme("sign-1bit");
  std::vector<float> x(32, 0.0f);
  x[0] = 1.0f;
  x[1] = -3.0f;
  x[2] = 0.5f;
  x[3] = -0.5f;
  // m = 5/32 = 0.15625 (fp16 0x3100); bit j of byte 0 is channel j, set for a negative value.
  EXPECT_EQ(encode(s, x, 32), (Bytes{0x00, 0x31, 0x0A, 0x00, 0x00, 0x00}));
  std::vector<float> y(32, 0.15625f);
  y[1] = y[3] = -0.15625f;
  EXPECT_EQ(round_trip(s, x, 32), y);
}

// ---- The rotation of rot-4bit

TEST(SchemeHadamard, FourVectorByHand) {
  // H_4 rows (Sylvester): ++++, +−+−, ++−−, +−−+; orthonormal: divided by √4 = 2.
  std::vector<double> x = {1, 2, 3, 4};
  fwht_orthonormal(x);
  EXPECT_EQ(x, (std::vector<double>{5, -1, -2, 0}));
  fwht_orthonormal(x);
  EXPECT_EQ(x, (std::vector<double>{1, 2, 3, 4})) << "the orthonormal transform is an involution";
  // The fixed signs σ_0..σ_7 (a known answer for the seed: the stored bytes depend on it).
  const double sigma[] = {1, -1, -1, 1, -1, 1, -1, -1};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(rotation_sign(c), sigma[c]) << c;
  // R·x = H_4·(1, −2, −3, 4)/2 = (0, −4, −2, 10)/2.
  rotate(x);
  EXPECT_EQ(x, (std::vector<double>{0, -2, -1, 5}));
  unrotate(x);
  EXPECT_EQ(x, (std::vector<double>{1, 2, 3, 4}));
}

TEST(SchemeHadamard, RotationIsOrthogonal) {
  std::mt19937_64 rng(3);
  for (int d : {32, 64, 128, 256}) {
    std::vector<double> x(d);
    for (double& v : x) v = draw_block(rng, 1, d)[0];
    const std::vector<double> x0 = x;
    rotate(x);
    const double n0 = std::sqrt(std::inner_product(x0.begin(), x0.end(), x0.begin(), 0.0));
    const double n1 = std::sqrt(std::inner_product(x.begin(), x.end(), x.begin(), 0.0));
    EXPECT_NEAR(n1, n0, 1e-12 * n0) << d;
    unrotate(x);
    for (int c = 0; c < d; ++c) EXPECT_NEAR(x[c], x0[c], 1e-12 * n0) << d;
  }
}

// ---- The group schemes on tiny blocks, by hand

TEST(SchemeKivi, KeyBlockByHand) {
  const KvScheme& s = kv_scheme("kivi-2bit", KvSide::key);
  ASSERT_EQ(s.tokens_per_block(), 32);
  const int d = 2;
  std::vector<float> x(32 * d);
  for (int t = 0; t < 32; ++t) {
    x[t * d + 0] = t < 16 ? 0.0f : 3.0f;  // lo 0, s 1: codes 0 then 3
    x[t * d + 1] = float(t % 4) - 2.0f;   // lo −2, s 1: codes t mod 4
  }
  x[5 * d + 1] = -0.375f;  // (−0.375 + 2)/1 = 1.625 → 2, decoded 0
  // Per channel: [s][lo][32 two-bit codes, token t in byte t/4 from the low bits up].
  const Bytes want = {0x00, 0x3C, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xFF, 0xFF, 0xFF, 0xFF,
                      0x00, 0x3C, 0x00, 0xC0, 0xE4, 0xE8, 0xE4, 0xE4, 0xE4, 0xE4, 0xE4, 0xE4};
  EXPECT_EQ(encode(s, x, d), want);
  std::vector<float> y = x;
  y[5 * d + 1] = 0.0f;
  EXPECT_EQ(round_trip(s, x, d), y);
}

TEST(SchemeKivi, ValuesArePerTokenRtn2bit) {
  const KvScheme& v = kv_scheme("kivi-2bit", KvSide::value);
  EXPECT_EQ(v.tokens_per_block(), 1);
  EXPECT_EQ(v.name(), "kivi-2bit");
  std::mt19937_64 rng(11);
  const std::vector<float> x = draw_block(rng, 1, 128);
  EXPECT_EQ(encode(v, x, 128), encode(kv_scheme("rtn-2bit"), x, 128));
}

TEST(SchemeKvquant, KeyBlockByHand) {
  const KvScheme& s = kv_scheme("kvquant-4", KvSide::key);
  ASSERT_EQ(s.tokens_per_block(), 32);
  const int d = 2;  // 64 entries: max(1, 64/100) = 1 outlier
  std::vector<float> x(32 * d);
  for (int t = 0; t < 32; ++t) {
    x[t * d + 0] = t % 2 ? 15.0f : 0.0f;  // lo 0, s 1: codes 0/15
    x[t * d + 1] = float(t % 16) - 8.0f;  // lo −8, s 1: codes t mod 16
  }
  x[7 * d + 0] = 100.0f;                  // the outlier (index 7·2 + 0 = 14): stored exactly, out of channel 0's range
  Bytes want = {0x00, 0x3C, 0x00, 0x00};  // channel 0: s = 1, lo = 0
  for (int i = 0; i < 16; ++i) want.push_back(i == 3 ? 0x00 : 0xF0);  // token 7 (high nibble of byte 3): code 0
  for (std::uint8_t b : {0x00, 0x3C, 0x00, 0xC8}) want.push_back(b);  // channel 1: s = 1, lo = −8
  for (int i = 0; i < 16; ++i) want.push_back(static_cast<std::uint8_t>(((2 * i) % 16) | (((2 * i + 1) % 16) << 4)));
  for (std::uint8_t b : {0x0E, 0x00, 0x40, 0x56}) want.push_back(b);  // (uint16 14, fp16 100)
  EXPECT_EQ(s.block_bytes(d), 44u);
  EXPECT_EQ(encode(s, x, d), want);
  EXPECT_EQ(round_trip(s, x, d), x);
}

TEST(SchemeKvquant, ValueTokenByHand) {
  const KvScheme& s = kv_scheme("kvquant-4", KvSide::value);
  ASSERT_EQ(s.tokens_per_block(), 1);
  const std::vector<float> x = {0.0f, -50.0f, 15.0f, 5.0f};  // −50 is the outlier; the rest: lo 0, s 1
  EXPECT_EQ(encode(s, x, 4), (Bytes{0x00, 0x3C, 0x00, 0x00, 0x00, 0x5F, 0x01, 0x00, 0x40, 0xD2}));
  EXPECT_EQ(round_trip(s, x, 4), x);
}

// ---- Round trips of every scheme and side, against bounds stated from each definition

// Bound (per element unless said otherwise) that decoded block y must satisfy for the exact block x.
void expect_within_definition(const std::string& name, KvSide side, const std::vector<float>& x,
                              const std::vector<float>& y, int d) {
  const int T = static_cast<int>(x.size()) / d;
  const auto float_slack = [](double v) { return std::fabs(v) * 0x1p-24; };  // the float decode
  // A symmetric or asymmetric record over the values x[idx] (skipping `skip`): |ŷ − x| ≤ s/2.
  const auto expect_rtn = [&](const std::vector<std::size_t>& idx, int bits, bool symmetric,
                              const std::set<std::size_t>& skip = {}) {
    double lo = INFINITY, hi = -INFINITY, amax = 0.0;
    for (std::size_t i : idx) {
      if (skip.count(i)) continue;
      lo = std::min(lo, double(x[i]));
      hi = std::max(hi, double(x[i]));
      amax = std::max(amax, std::fabs(double(x[i])));
    }
    const double s =
        symmetric ? fp16_up(amax / ((1 << (bits - 1)) - 1)) : fp16_up((hi - fp16_down(lo)) / ((1 << bits) - 1));
    for (std::size_t i : idx) {
      if (skip.count(i)) {
        ASSERT_EQ(y[i], x[i]) << name << ": sparse outliers are exact, entry " << i;
      } else {
        ASSERT_LE(std::fabs(double(y[i]) - x[i]), s / 2 + float_slack(y[i])) << name << " entry " << i;
      }
    }
  };
  const auto channel_groups = [&] {  // per token, groups of 32 channels
    std::vector<std::vector<std::size_t>> groups;
    for (int g = 0; g < d / 32; ++g) {
      groups.emplace_back();
      for (int c = g * 32; c < g * 32 + 32; ++c) groups.back().push_back(c);
    }
    return groups;
  };
  const auto token_columns = [&] {  // per channel, the T tokens of the block
    std::vector<std::vector<std::size_t>> cols(d);
    for (int c = 0; c < d; ++c)
      for (int t = 0; t < T; ++t) cols[c].push_back(static_cast<std::size_t>(t) * d + c);
    return cols;
  };
  // KVQuant's outliers, found independently: the max(1, n/100) largest magnitudes, lower index first on ties.
  const auto top_entries = [&](std::size_t n) {
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
    order.resize(std::max<std::size_t>(1, n / 100));
    return std::set<std::size_t>(order.begin(), order.end());
  };

  if (name == "fp16") {
    for (std::size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(y[i]), std::bit_cast<std::uint32_t>(x[i]));
  } else if (name == "fp8-e4m3") {
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (std::fabs(x[i]) > 448.0) {
        ASSERT_EQ(y[i], std::copysign(448.0f, x[i])) << "saturates";
      } else {
        ASSERT_LE(std::fabs(double(y[i]) - x[i]), std::max(std::fabs(double(x[i])) * 0x1p-4, 0x1p-10)) << x[i];
      }
    }
  } else if (name == "fp8-e4m3-scaled") {
    double amax = 0.0;
    for (float v : x) amax = std::max(amax, std::fabs(double(v)));
    const double s = fp16_up(amax / 448.0);
    for (std::size_t i = 0; i < x.size(); ++i)
      ASSERT_LE(std::fabs(double(y[i]) - x[i]), std::max(std::fabs(double(x[i])) * 0x1p-4, s * 0x1p-10)) << x[i];
  } else if (name == "rtn-int8" || name == "rtn-int4") {
    for (const auto& g : channel_groups()) expect_rtn(g, name == "rtn-int8" ? 8 : 4, true);
  } else if (name == "rtn-2bit" || (name == "kivi-2bit" && side == KvSide::value)) {
    for (const auto& g : channel_groups()) expect_rtn(g, 2, false);
  } else if (name == "kivi-2bit") {
    for (const auto& col : token_columns()) expect_rtn(col, 2, false);
  } else if (name == "kvquant-4" && side == KvSide::key) {
    const std::set<std::size_t> outliers = top_entries(x.size());
    for (const auto& col : token_columns()) expect_rtn(col, 4, false, outliers);
  } else if (name == "kvquant-4") {
    std::vector<std::size_t> all(d);
    std::iota(all.begin(), all.end(), 0);
    expect_rtn(all, 4, false, top_entries(d));
  } else if (name == "sign-1bit") {
    for (const auto& g : channel_groups()) {
      double sum = 0.0;
      for (std::size_t i : g) sum += std::fabs(x[i]);
      const float m = as_fp16(sum / 32);
      for (std::size_t i : g) ASSERT_EQ(y[i], std::signbit(x[i]) ? -m : m);
    }
  } else if (name == "rot-4bit") {
    // ‖x̂ − x‖ = ‖ŷ − R·x‖ (R orthogonal) ≤ √(Σ_g 32·s_g²/4), s_g = fp16_up(amax_g(R·x)/7); slack
    // for the double transforms and the float output.
    std::vector<double> rx(x.begin(), x.end());
    rotate(rx);
    double bound2 = 0.0, err2 = 0.0, norm2 = 0.0;
    for (int g = 0; g < d / 32; ++g) {
      double amax = 0.0;
      for (int c = g * 32; c < g * 32 + 32; ++c) amax = std::max(amax, std::fabs(rx[c]));
      bound2 += 32 * std::pow(fp16_up(amax / 7) / 2, 2);
    }
    for (int c = 0; c < d; ++c) {
      err2 += std::pow(double(y[c]) - x[c], 2);
      norm2 += double(x[c]) * x[c];
    }
    ASSERT_LE(std::sqrt(err2), std::sqrt(bound2) + 0x1p-22 * std::sqrt(norm2));
  } else {
    // llama.cpp's formats: bit-exact with the reference quantizer and dequantizer.
    const std::map<std::string, GgmlType> types = {{"q8_0", GgmlType::Q8_0}, {"q4_0", GgmlType::Q4_0},
                                                   {"q4_1", GgmlType::Q4_1}, {"q5_0", GgmlType::Q5_0},
                                                   {"q5_1", GgmlType::Q5_1}, {"iq4_nl", GgmlType::IQ4_NL}};
    ASSERT_TRUE(types.count(name)) << "no bound stated for scheme " << name;
    const GgmlType t = types.at(name);
    Bytes ref(ggml_row_bytes(t, d));
    quantize_row(t, x.data(), ref.data(), d);
    std::vector<float> want(d);
    dequantize_row(t, ref.data(), want.data(), d);
    for (int c = 0; c < d; ++c)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(y[c]), std::bit_cast<std::uint32_t>(want[c])) << name;
  }
}

struct Side {
  std::string name;
  KvSide side;
};

std::vector<Side> every_scheme_and_side() {
  std::vector<Side> all;
  for (const std::string& n : kv_scheme_names())
    for (KvSide side : {KvSide::key, KvSide::value}) all.push_back({n, side});
  return all;
}

TEST(SchemeRoundTrip, WithinEachDefinitionsBound) {
  std::mt19937_64 rng(1);
  for (const auto& [name, side] : every_scheme_and_side()) {
    const KvScheme& s = kv_scheme(name, side);
    for (int d : {64, 128}) {
      for (int trial = 0; trial < 50; ++trial) {
        const std::vector<float> x = draw_block(rng, s.tokens_per_block(), d);
        const std::vector<float> y = round_trip(s, x, d);
        expect_within_definition(name, side, x, y, d);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(SchemeRoundTrip, EncodingIsDeterministicAndWritesEveryByte) {
  std::mt19937_64 rng(2);
  for (const auto& [name, side] : every_scheme_and_side()) {
    const KvScheme& s = kv_scheme(name, side);
    const int d = 128;
    const std::vector<float> x = draw_block(rng, s.tokens_per_block(), d);
    Bytes a(s.block_bytes(d), 0x00), b(s.block_bytes(d), 0xFF);
    s.encode(x.data(), d, a.data());
    s.encode(x.data(), d, b.data());
    EXPECT_EQ(a, b) << name << ": the same block must give the same bytes whatever the buffer held";
  }
}

TEST(SchemeRoundTrip, ZeroBlocksDecodeToZero) {
  for (const auto& [name, side] : every_scheme_and_side()) {
    const KvScheme& s = kv_scheme(name, side);
    for (int d : {64, 128}) {
      const std::vector<float> y =
          round_trip(s, std::vector<float>(static_cast<std::size_t>(s.tokens_per_block()) * d, 0.0f), d);
      for (float v : y) ASSERT_EQ(v, 0.0f) << name;
    }
  }
}

TEST(SchemeRoundTrip, HugeValuesStayFiniteAndWithinBound) {
  std::mt19937_64 rng(4);
  for (const auto& [name, side] : every_scheme_and_side()) {
    const KvScheme& s = kv_scheme(name, side);
    const int d = 64;
    std::vector<float> x = draw_block(rng, s.tokens_per_block(), d);
    for (std::size_t i = 0; i < x.size(); i += 3) x[i] = i % 2 ? -65504.0f : 65504.0f;  // ±fp16 max
    const std::vector<float> y = round_trip(s, x, d);
    for (float v : y) ASSERT_TRUE(std::isfinite(v)) << name;
    expect_within_definition(name, side, x, y, d);
    if (HasFatalFailure()) return;
  }
}

TEST(SchemeRoundTrip, NonFiniteInputNeverDecodesFinite) {
  std::mt19937_64 rng(5);
  for (const auto& [name, side] : every_scheme_and_side()) {
    const KvScheme& s = kv_scheme(name, side);
    const int d = 64, T = s.tokens_per_block();
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      for (std::size_t at : {std::size_t{0}, std::size_t{37}, static_cast<std::size_t>(T) * d - 1}) {
        std::vector<float> x = draw_block(rng, T, d);
        x[at] = bad;
        const std::vector<float> y = round_trip(s, x, d);
        EXPECT_FALSE(std::isfinite(y[at])) << name << (side == KvSide::key ? " K" : " V") << ": input " << bad << " at "
                                           << at << " decoded to " << y[at];
      }
    }
  }
}

TEST(SchemeRoundTrip, NonFiniteSpoilsOnlyItsGroupInLlamaCppFormats) {
  std::mt19937_64 rng(6);
  for (const char* name : {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"}) {
    const KvScheme& s = kv_scheme(name);
    std::vector<float> x = draw_block(rng, 1, 128);
    const std::vector<float> clean = round_trip(s, x, 128);
    x[70] = NAN;  // block 2 of 4
    const std::vector<float> y = round_trip(s, x, 128);
    for (int c = 0; c < 128; ++c) {
      if (c / 32 == 2) {
        EXPECT_TRUE(std::isnan(y[c])) << name << " " << c;
      } else {
        EXPECT_EQ(y[c], clean[c]) << name << " " << c;
      }
    }
  }
}

TEST(SchemeRoundTrip, Rot4bitOverflowingScaleDecodesNonFinite) {
  // x = 65504·σ∘h_0 rotates to 65504·√64·e_0: amax/7 = 74862 overflows fp16, so the token
  // decodes non-finite ("no guarantee") rather than clipped.
  const int d = 64;
  std::vector<float> x(d);
  for (int c = 0; c < d; ++c) x[c] = static_cast<float>(65504.0 * rotation_sign(c));
  for (float v : round_trip(kv_scheme("rot-4bit"), x, d)) EXPECT_FALSE(std::isfinite(v));
}

// ---- The registry

// Every scheme's encode and decode, both sides, allocate nothing once their first call on a thread
// has grown its scratch, at every head dimension the scheme takes, with outliers and non-finite
// values: a cache's writes and black-box reads stay allocation-free whatever the format.
TEST(SchemeRoundTrip, CodecsAllocateNothingOnceWarm) {
  std::mt19937_64 rng(11);
  int checked = 0;
  for (const auto& [name, side] : every_scheme_and_side()) {
    const KvScheme& s = kv_scheme(name, side);
    for (int d : {32, 64, 128, 256}) {
      std::vector<float> x = draw_block(rng, s.tokens_per_block(), d);
      Bytes b(s.block_bytes(d));
      std::vector<float> y(x.size());
      for (int warm = 0; warm < 2; ++warm) {  // the scratch grows to this d, on the finite and non-finite paths
        if (warm == 1) x[1] = INFINITY;
        s.encode(x.data(), d, b.data());
        s.decode(b.data(), d, y.data());
      }
      for (int trial = 0; trial < 3; ++trial) {
        x = draw_block(rng, s.tokens_per_block(), d);
        if (trial == 2) x[1] = INFINITY;  // the non-finite paths too
        const long before = testing_util::thread_allocations();
        s.encode(x.data(), d, b.data());
        s.decode(b.data(), d, y.data());
        EXPECT_EQ(testing_util::thread_allocations() - before, 0)
            << name << (side == KvSide::key ? " keys" : " values") << " d " << d << " trial " << trial;
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 100);
}

TEST(SchemeRegistry, NamesKindsAndBlockBytes) {
  struct Expect {
    const char* name;
    int key_T, value_T;
    std::size_t key_bytes, value_bytes;  // block_bytes at head_dim 64, from each layout
  };
  const Expect expect[] = {
      {"fp16", 1, 1, 128, 128},
      {"fp8-e4m3", 1, 1, 64, 64},
      {"fp8-e4m3-scaled", 1, 1, 66, 66},
      {"rtn-int8", 1, 1, 68, 68},
      {"rtn-int4", 1, 1, 36, 36},
      {"rtn-2bit", 1, 1, 24, 24},
      {"sign-1bit", 1, 1, 12, 12},
      {"rot-4bit", 1, 1, 36, 36},
      {"kivi-2bit", 32, 1, 64 * 12, 24},                       // per channel 4 + 8 bytes
      {"kvquant-4", 32, 1, 64 * 20 + 20 * 4, 2 + 2 + 32 + 4},  // 2048 entries: 20 outliers; d = 64: 1
      {"q8_0", 1, 1, 68, 68},
      {"q4_0", 1, 1, 36, 36},
      {"q4_1", 1, 1, 40, 40},
      {"q5_0", 1, 1, 44, 44},
      {"q5_1", 1, 1, 48, 48},
      {"iq4_nl", 1, 1, 36, 36},
  };
  std::set<std::string> names;
  for (const std::string& n : kv_scheme_names()) names.insert(n);
  EXPECT_EQ(names.size(), std::size(expect));
  for (const Expect& e : expect) {
    EXPECT_TRUE(names.count(e.name)) << e.name;
    const KvScheme& k = kv_scheme(e.name, KvSide::key);
    const KvScheme& v = kv_scheme(e.name, KvSide::value);
    EXPECT_EQ(&kv_scheme(e.name), &k) << "the key side is the default";
    EXPECT_EQ(k.name(), e.name);
    EXPECT_EQ(v.name(), e.name);
    EXPECT_EQ(k.tokens_per_block(), e.key_T) << e.name;
    EXPECT_EQ(v.tokens_per_block(), e.value_T) << e.name;
    EXPECT_EQ(k.block_bytes(64), e.key_bytes) << e.name;
    EXPECT_EQ(v.block_bytes(64), e.value_bytes) << e.name;
    EXPECT_EQ(k.bytes_per_token(64), double(e.key_bytes) / e.key_T) << e.name;
    EXPECT_EQ(k.exact(), std::string(e.name) == "fp16");
  }
}

TEST(SchemeRegistry, UnknownNameListsTheKnownOnes) {
  try {
    kv_scheme("int3-magic");
    FAIL() << "an unknown name must throw";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("int3-magic"), std::string::npos) << what;
    for (const std::string& n : kv_scheme_names()) EXPECT_NE(what.find(n), std::string::npos) << what;
  }
  EXPECT_THROW(kv_scheme("FP16"), std::invalid_argument);
  EXPECT_THROW(kv_scheme(""), std::invalid_argument);
}

TEST(SchemeRegistry, UnsuitableHeadDimsThrowClearly) {
  struct Case {
    const char* name;
    KvSide side;
    int d;
    const char* says;
  };
  const Case cases[] = {
      {"fp16", KvSide::key, 0, "positive"},
      {"rtn-int8", KvSide::key, 48, "multiple of 32"},
      {"sign-1bit", KvSide::value, 16, "multiple of 32"},
      {"rot-4bit", KvSide::key, 96, "power of two"},
      {"rot-4bit", KvSide::key, 16, "power of two"},
      {"kivi-2bit", KvSide::value, 40, "multiple of 32"},
      {"kvquant-4", KvSide::key, 4096, "16-bit"},
      {"q4_0", KvSide::key, 80, "multiple of 32"},
  };
  for (const Case& c : cases) {
    const KvScheme& s = kv_scheme(c.name, c.side);
    try {
      s.block_bytes(c.d);
      ADD_FAILURE() << c.name << " accepted head_dim " << c.d;
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(c.name), std::string::npos) << what;
      EXPECT_NE(what.find(c.says), std::string::npos) << what;
      EXPECT_NE(what.find(std::to_string(c.d)), std::string::npos) << what;
    }
    std::vector<float> x(4096 * 32, 0.0f);
    std::vector<std::uint8_t> b(1 << 20);
    EXPECT_THROW(s.encode(x.data(), c.d, b.data()), std::invalid_argument) << c.name;
    EXPECT_THROW(s.decode(b.data(), c.d, x.data()), std::invalid_argument) << c.name;
  }
}

}  // namespace
}  // namespace witcert::formats
