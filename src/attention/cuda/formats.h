// The per-token math of every key and value format, for host and device: Philox4x32-10 and the
// dither ξ (formats/dither/philox.h, formats/dither/dither.h), the decoders of fp16, dither-int8, q8_0, q4_0 and
// fp8-e4m3 (formats::KvScheme::decode, bit for bit), and the bounds: the band norms ‖q_b‖ and
// Theorem 2's c_t (cert/witness.h), Lemma 2's ς_t² and u_t (cert/subgaussian.h), and the value
// side's ρ_t (kvcache/kv_store.cc). Each reproduces its CPU counterpart operation for operation;
// formats_test.cc checks them bit for bit.
#pragma once

#include <cstdint>

#include "attention/cuda/hd.h"

namespace witcert::cuda {

enum class Format : int { fp16, dither_int8, q8_0, q4_0, fp8_e4m3 };

inline constexpr int kGroup = 32;  // dither-int8's G_c; q8_0 and q4_0 blocks are 32 values too

// Philox4x32-10 (Salmon et al.): ten rounds on counter (c0, c1, c2, c3) under key (k0, k1).
struct Philox4 {
  std::uint32_t v[4];
};
WITCERT_HD Philox4 philox4x32_10(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2, std::uint32_t c3, std::uint32_t k0,
                                 std::uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const std::uint64_t p0 = static_cast<std::uint64_t>(0xD2511F53u) * c0;
    const std::uint64_t p1 = static_cast<std::uint64_t>(0xCD9E8D57u) * c2;
    const std::uint32_t n0 = static_cast<std::uint32_t>(p1 >> 32) ^ c1 ^ k0, n1 = static_cast<std::uint32_t>(p1);
    const std::uint32_t n2 = static_cast<std::uint32_t>(p0 >> 32) ^ c3 ^ k1, n3 = static_cast<std::uint32_t>(p0);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
  }
  return {{c0, c1, c2, c3}};
}

// ξ from one Philox word: its top 24 bits on the grid k·2^-24 − ½ (formats::dither_from_bits).
WITCERT_HD float dither_from_bits(std::uint32_t u) { return static_cast<float>(u >> 8) * 0x1p-24f - 0.5f; }

// ξ of channels 4j .. 4j+3 of the token named `counter` in stream (seed, layer, kv_head): the counter
// (counter, j, kv_head, layer) under key (seed_lo, seed_hi), as formats::dither_values.
WITCERT_HD void dither_quad(std::uint64_t seed, std::uint32_t layer, std::uint32_t kv_head, std::uint32_t counter,
                            std::uint32_t j, float xi[4]) {
  const Philox4 w = philox4x32_10(counter, j, kv_head, layer, static_cast<std::uint32_t>(seed),
                                  static_cast<std::uint32_t>(seed >> 32));
  for (int i = 0; i < 4; ++i) xi[i] = dither_from_bits(w.v[i]);
}

// x̂_c = s·(code − ξ) of a dither-int8 channel (formats::decode_dither): in double, then float.
WITCERT_HD float dither_decode(std::int8_t code, std::uint16_t scale, float xi) {
  const double s = half_to_double(scale);
  return static_cast<float>(s * (static_cast<double>(code) - static_cast<double>(xi)));
}

// fp8-e4m3 bits to their exact value (formats::fp8_e4m3_to_double, as a float).
WITCERT_HD float fp8_e4m3_to_float(std::uint8_t b) {
  const int exponent = (b >> 3) & 0xF, mantissa = b & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7)
    magnitude = NAN;
  else if (exponent == 0)
    magnitude = static_cast<float>(mantissa) * 0x1p-9f;
  else
    magnitude = static_cast<float>(8 + mantissa) * bits_to_float(static_cast<std::uint32_t>(exponent - 10 + 127) << 23);
  return (b & 0x80) ? -magnitude : magnitude;
}

// Bytes of one packed token of d values.
WITCERT_HD int packed_row_bytes(Format f, int d) {
  switch (f) {
    case Format::q8_0: return d / 32 * 34;
    case Format::q4_0: return d / 32 * 18;
    case Format::fp8_e4m3: return d;
    default: return 0;
  }
}

WITCERT_HD std::uint16_t load_u16(const std::uint8_t* p) { return static_cast<std::uint16_t>(p[0] | (p[1] << 8)); }

// Value c of a packed per-token scheme row (llama.cpp's dequantize_row for q8_0 and q4_0).
WITCERT_HD float packed_decode(Format f, const std::uint8_t* row, int c) {
  switch (f) {
    case Format::q8_0: {
      const std::uint8_t* b = row + (c / 32) * 34;
      return static_cast<float>(static_cast<std::int8_t>(b[2 + c % 32])) * half_to_float(load_u16(b));
    }
    case Format::q4_0: {
      const std::uint8_t* b = row + (c / 32) * 18;
      const int j = c % 32;
      const int nibble = j < 16 ? (b[2 + j] & 0x0F) : (b[2 + j - 16] >> 4);
      return static_cast<float>(nibble - 8) * half_to_float(load_u16(b));
    }
    case Format::fp8_e4m3: return fp8_e4m3_to_float(row[c]);
    default: return NAN;
  }
}

// Coordinate i of band b (cert::BandLayout::coordinate): pair j = (2j, 2j+1) interleaved, (j, j + d/2)
// NeoX.
WITCERT_HD int band_coordinate(bool neox, int d, int bands, int b, int i) {
  const int j = b * (d / (2 * bands)) + i / 2;
  const int lo = neox ? j : 2 * j, hi = neox ? j + d / 2 : 2 * j + 1;
  return i % 2 == 0 ? lo : hi;
}

// ‖q_b‖ rounded up (cert::band_norms) of one band.
WITCERT_HD double band_norm(const float* q, bool neox, int d, int bands, int b) {
  double sum = 0.0;
  for (int i = 0; i < d / bands; ++i) {
    const double x = static_cast<double>(q[band_coordinate(neox, d, bands, b, i)]);
    sum += x * x;
  }
  return sqrt(sum) * kRoundUpMargin;
}

// Theorem 2: c_t = sm·Σ_b ‖q_b‖·w_{t,b} rounded up (cert::tier_a_c).
WITCERT_HD double tier_a_c(const double* q_norm, const std::uint16_t* w, int bands, double sm) {
  double sum = 0.0;
  for (int b = 0; b < bands; ++b) {
    if (q_norm[b] == 0.0) continue;
    sum += q_norm[b] * half_to_double(w[b]);
  }
  const double c = sm * sum * kRoundUpMargin;
  return is_nan(c) ? kInf : c;
}

// Lemma 2's ς_t² = (sm²/12) Σ_{c non-outlier} q_c² s_{g(c)}² (cert::dither_variance_proxy).
WITCERT_HD double dither_variance_proxy(const float* q, const std::uint16_t* scales, const std::int8_t* outlier_rank, int d,
                                        double sm) {
  double sum = 0.0;
  for (int c = 0; c < d; ++c) {
    if (outlier_rank[c] >= 0) continue;
    const double qc = q[c];
    if (qc == 0.0) continue;
    const double s = half_to_double(scales[c / kGroup]);
    sum += qc * qc * s * s;
  }
  const double v = sm * sm / 12.0 * sum * kRoundUpMargin;
  return is_nan(v) ? kInf : v;
}

// ς_t² as the kernel evaluates it: Σ_g Q_g·s_g² with Q_g = Σ_{c∈g non-outlier} q_c² summed once per
// query (group_q2), G terms per token instead of d. The same non-negative terms as
// dither_variance_proxy's in another order, which its margin kRoundUpMargin covers (a sum of
// d + G non-negative terms rounds by at most (d + G + 3)·2^-53 relative in any order; docs/cuda.md).
WITCERT_HD double dither_variance_grouped(const double* q2, const std::uint16_t* scales, int groups, double sm) {
  double sum = 0.0;
  for (int g = 0; g < groups; ++g) {
    if (q2[g] == 0.0) continue;  // every q_c of the group is 0: dither_variance_proxy skips them all
    const double s = half_to_double(scales[g]);
    sum += q2[g] * (s * s);
  }
  const double v = sm * sm / 12.0 * sum * kRoundUpMargin;
  return is_nan(v) ? kInf : v;
}

// Q_g = Σ_{c∈g non-outlier} q_c² of group g (dither_variance_grouped).
WITCERT_HD double group_q2(const float* q, const std::int8_t* outlier_rank, int g) {
  double sum = 0.0;
  for (int c = g * kGroup; c < (g + 1) * kGroup; ++c)
    if (outlier_rank[c] < 0) sum += static_cast<double>(q[c]) * q[c];
  return sum;
}

// u_t = ς_t·(tail + bias) rounded up (cert::subgaussian_radius), with tail + bias = κ computed once
// per (sequence, stream) on the host by subgaussian_kappa.
WITCERT_HD double subgaussian_radius(double varsigma2, double kappa) {
  const double u = sqrt(varsigma2) * kappa * kRoundUpMargin;
  return is_nan(u) ? kInf : u;
}

// ρ_t ≥ ‖v̂_t − v_t‖ of a dither-int8 value from its group scales (kvcache::dither_value_rho).
WITCERT_HD double dither_value_rho(const std::uint16_t* scales, int groups) {
  double sum = 0.0;
  for (int g = 0; g < groups; ++g) {
    const double half = half_to_double(scales[g]) * (0.5 + 0x1p-17);
    sum += kGroup * half * half;
  }
  return sqrt(sum) * kRoundUpMargin;
}

}  // namespace witcert::cuda
