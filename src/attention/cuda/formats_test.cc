// The CUDA kernel's per-token math (formats.h), run on the host, against the CPU code it must
// reproduce bit for bit.
#include "attention/cuda/formats.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <span>
#include <vector>

#include "attention/cuda/mirror.h"
#include "base/fp16.h"
#include "cert/subgaussian.h"
#include "cert/witness.h"
#include "formats/dither/dither.h"
#include "formats/dither/philox.h"
#include "formats/fp8/fp8.h"
#include "formats/schemes.h"

namespace witcert::cuda {
namespace {

bool same_bits(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (a != a && b != b); }
bool same_bits(double a, double b) { return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b) || (a != a && b != b); }

TEST(CudaFormats, HalfToFloatMatchesEveryFp16Pattern) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const f16 x = static_cast<f16>(h);
    ASSERT_TRUE(same_bits(half_to_float(x), fp16_to_float(x))) << std::hex << h;
    ASSERT_TRUE(same_bits(half_to_double(x), fp16_to_double(x))) << std::hex << h;
  }
}

TEST(CudaFormats, PhiloxKnownAnswersAndTheCpuDitherStream) {
  // Random123's kat_vectors for philox4x32 with 10 rounds.
  const Philox4 a = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(a.v[0], 0x6627e8d5u);
  EXPECT_EQ(a.v[3], 0x9b00dbd8u);
  const Philox4 b = philox4x32_10(0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0);
  EXPECT_EQ(b.v[0], 0xd16cfe09u);
  EXPECT_EQ(b.v[1], 0x94fdcceb);
  EXPECT_EQ(b.v[2], 0x5001e420u);
  EXPECT_EQ(b.v[3], 0x24126ea1u);
  // ξ of every channel of slot and page counters (top bit set) as formats::dither_values draws them.
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const formats::DitherStream stream{rng(), static_cast<std::uint32_t>(rng() % 32), static_cast<std::uint32_t>(rng() % 8)};
    const std::uint32_t counter = static_cast<std::uint32_t>(rng()) | (trial % 2 ? 0x80000000u : 0u);
    std::vector<float> cpu(128);
    formats::dither_values(stream, counter, cpu);
    for (int j = 0; j < 32; ++j) {
      float xi[4];
      dither_quad(stream.seed, stream.layer, stream.kv_head, counter, static_cast<std::uint32_t>(j), xi);
      for (int i = 0; i < 4; ++i) ASSERT_TRUE(same_bits(xi[i], cpu[4 * j + i])) << trial << " channel " << 4 * j + i;
    }
  }
}

TEST(CudaFormats, Fp8DecodeMatchesTheReferenceForEveryPattern) {
  for (int b = 0; b < 256; ++b)
    EXPECT_TRUE(same_bits(static_cast<double>(fp8_e4m3_to_float(static_cast<std::uint8_t>(b))),
                          formats::fp8_e4m3_to_double(static_cast<std::uint8_t>(b))))
        << b;
}

TEST(CudaFormats, PackedDecodeMatchesTheSchemes) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (const auto& [name, format] : {std::pair{"q8_0", Format::q8_0}, {"q4_0", Format::q4_0}, {"fp8-e4m3", Format::fp8_e4m3}}) {
    const formats::KvScheme& scheme = formats::kv_scheme(name);
    for (int d : {32, 64, 128, 256}) {
      ASSERT_EQ(static_cast<std::size_t>(packed_row_bytes(format, d)), scheme.block_bytes(d)) << name;
      std::vector<float> x(d), cpu(d);
      std::vector<std::uint8_t> row(scheme.block_bytes(d));
      for (int trial = 0; trial < 50; ++trial) {
        const float gain = std::exp(4.0f * g(rng));
        for (float& v : x) v = gain * g(rng);
        scheme.encode(x.data(), d, row.data());
        scheme.decode(row.data(), d, cpu.data());
        for (int c = 0; c < d; ++c) ASSERT_TRUE(same_bits(packed_decode(format, row.data(), c), cpu[c])) << name << " c=" << c;
      }
    }
  }
}

TEST(CudaFormats, DitherDecodeMatchesTheCpuDecoder) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int d = 64;
  std::vector<float> x(d), xi(d), cpu(d);
  std::vector<std::uint8_t> outlier(d, 0);
  outlier[6] = outlier[7] = 1;
  std::vector<std::int8_t> codes(d);
  std::vector<f16> scales(d / 32), outliers(2);
  for (int trial = 0; trial < 100; ++trial) {
    for (float& v : x) v = 3.0f * g(rng);
    formats::dither_values({rng(), 1, 2}, static_cast<std::uint32_t>(rng()), xi);
    formats::encode_dither(8, x, xi, outlier, 32, codes, scales, outliers);
    formats::decode_dither(codes, scales, xi, outlier, outliers, 32, cpu);
    for (int c = 0; c < d; ++c) {
      if (outlier[c]) continue;
      ASSERT_TRUE(same_bits(dither_decode(codes[c], scales[c / 32], xi[c]), cpu[c])) << c;
    }
  }
}

TEST(CudaFormats, BoundsMatchTheCertLayer) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (const cert::RopeLayout layout : {cert::RopeLayout::interleaved, cert::RopeLayout::neox})
    for (const auto& [d, bands] : {std::pair{64, 16}, {128, 16}, {128, 8}}) {
      const cert::BandLayout bl(d, bands, layout);
      std::vector<float> q(d), k(d), k_hat(d);
      std::vector<double> cpu_norms(bands), norms(bands);
      std::vector<f16> w(bands), scales(d / 32);
      std::vector<std::uint8_t> mask(d, 0);
      std::vector<std::int8_t> rank(d, -1);
      mask[2] = mask[3] = 1, rank[2] = 0, rank[3] = 1;
      for (int trial = 0; trial < 50; ++trial) {
        for (int c = 0; c < d; ++c) q[c] = g(rng), k[c] = g(rng), k_hat[c] = k[c] + 0.01f * g(rng);
        if (trial % 5 == 0) q[0] = q[1] = 0.0f;  // a band with ‖q_b‖ = 0
        cert::band_norms(bl, q, cpu_norms);
        for (int b = 0; b < bands; ++b) {
          norms[b] = band_norm(q.data(), layout == cert::RopeLayout::neox, d, bands, b);
          ASSERT_TRUE(same_bits(norms[b], cpu_norms[b])) << b;
        }
        cert::tier_a_witness(bl, k_hat, k, w);
        if (trial % 7 == 0) w[0] = kFp16PosInf;
        const double sm = 1.0 / std::sqrt(static_cast<double>(d));
        ASSERT_TRUE(same_bits(tier_a_c(norms.data(), w.data(), bands, sm), cert::tier_a_c(cpu_norms, w, sm)));
        for (f16& s : scales) s = fp16_from_double(std::fabs(0.05 * g(rng)), Round::up);
        if (trial % 9 == 0) scales[0] = kFp16PosInf;
        const double v2 = dither_variance_proxy(q.data(), scales.data(), rank.data(), d, sm);
        ASSERT_TRUE(same_bits(v2, cert::dither_variance_proxy(q, scales, mask, 32, sm)));
        // The kernel's grouped order: within rounding of the channel order, and above the exact ς².
        std::vector<double> q2(d / 32);
        for (int g = 0; g < d / 32; ++g) q2[g] = group_q2(q.data(), rank.data(), g);
        const double grouped = dither_variance_grouped(q2.data(), scales.data(), d / 32, sm);
        long double exact = 0.0L;
        for (int c = 0; c < d; ++c)
          if (!mask[c]) exact += static_cast<long double>(q[c]) * q[c] * fp16_to_double(scales[c / 32]) * fp16_to_double(scales[c / 32]);
        exact *= static_cast<long double>(sm) * sm / 12.0L;
        if (std::isinf(v2)) {
          ASSERT_EQ(grouped, v2);
        } else {
          ASSERT_NEAR(grouped, v2, 1e-14 * v2);
          ASSERT_GE(static_cast<long double>(grouped), exact);
        }
        const long S = 1 + static_cast<long>(rng() % 100000);
        const double delta = cert::delta_loc(1e-2, 30, 9, 256);
        ASSERT_TRUE(same_bits(subgaussian_radius(v2, subgaussian_kappa(S, delta, d - 2)),
                              cert::subgaussian_radius(v2, S, delta, d - 2)));
      }
    }
}

}  // namespace
}  // namespace witcert::cuda
