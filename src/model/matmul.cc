#include "model/matmul.h"

#include <algorithm>
#include <cstring>
#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/fp16.h"

// The kernels keep small arrays of vectors, which sizeless vector types (SVE, RVV) do not allow.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "model/matmul.cc"
#include "hwy/cache_control.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::model {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using formats::GgmlType;
using DF = hn::CappedTag<float, 16>;  // 16 lanes at most: a 32-weight block is whole vectors
using VF = hn::Vec<DF>;
constexpr std::size_t kLanes = hn::MaxLanes(DF());
constexpr std::size_t kGroup = 32;  // columns decoded at once: one block of the 32-element types
constexpr std::size_t kVecs = kGroup / kLanes;

// The fp16 at p, broadcast.
HWY_INLINE VF ScaleAt(const std::uint8_t* p) {
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<hwy::float16_t, decltype(d1)> dh1;
  return hn::Set(DF(), hn::GetLane(hn::PromoteTo(d1, hn::LoadU(dh1, reinterpret_cast<const hwy::float16_t*>(p)))));
}

// Decoders: the 32 weights of group g of a row (a block, 32 consecutive 16/32-bit floats, or a
// K-quant's sub-block) as kVecs vectors, in column order; kBytes is a group's share of the row,
// which places the prefetch. The weights match formats::dequantize_row up to the rounding of a
// fused multiply-add where ggml rounds the product and the sum separately.

// The 16 bytes at qs hold 32 nibbles: low nibbles are columns 0..15, high nibbles 16..31.
template <class Fn>
HWY_INLINE void DecodeNibbles(const std::uint8_t* qs, VF* w, Fn to_weight) {
  const hn::Rebind<std::uint8_t, DF> du8;
  const hn::Rebind<std::int32_t, DF> di32;
  const auto low = hn::Set(di32, 0x0F);
  for (std::size_t k = 0; k < 16 / kLanes; ++k) {
    const auto q = hn::PromoteTo(di32, hn::LoadU(du8, qs + k * kLanes));
    w[k] = to_weight(hn::ConvertTo(DF(), hn::And(q, low)));
    w[k + 16 / kLanes] = to_weight(hn::ConvertTo(DF(), hn::ShiftRight<4>(q)));
  }
}

struct DecodeQ4_0 {  // d, qs[16]: w = (q − 8)·d
  static constexpr std::size_t kBytes = 18;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    const std::uint8_t* p = row + g * kBytes;
    const VF d = ScaleAt(p);
    const VF offset = hn::Mul(d, hn::Set(DF(), -8.0f));
    DecodeNibbles(p + 2, w, [&](VF q) { return hn::MulAdd(q, d, offset); });
  }
};

struct DecodeQ4_1 {  // d, m, qs[16]: w = q·d + m
  static constexpr std::size_t kBytes = 20;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    const std::uint8_t* p = row + g * kBytes;
    const VF d = ScaleAt(p), m = ScaleAt(p + 2);
    DecodeNibbles(p + 4, w, [&](VF q) { return hn::MulAdd(q, d, m); });
  }
};

struct DecodeQ8_0 {  // d, qs[32] (int8): w = q·d
  static constexpr std::size_t kBytes = 34;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    const std::uint8_t* p = row + g * kBytes;
    const hn::Rebind<std::int8_t, DF> di8;
    const hn::Rebind<std::int32_t, DF> di32;
    const VF d = ScaleAt(p);
    const std::int8_t* qs = reinterpret_cast<const std::int8_t*>(p + 2);
    for (std::size_t k = 0; k < kVecs; ++k)
      w[k] = hn::Mul(hn::ConvertTo(DF(), hn::PromoteTo(di32, hn::LoadU(di8, qs + k * kLanes))), d);
  }
};

struct DecodeF16 {
  static constexpr std::size_t kBytes = 2 * kGroup;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    const std::uint8_t* p = row + g * kBytes;
    const hn::Rebind<hwy::float16_t, DF> df16;
    const hwy::float16_t* h = reinterpret_cast<const hwy::float16_t*>(p);
    for (std::size_t k = 0; k < kVecs; ++k) w[k] = hn::PromoteTo(DF(), hn::LoadU(df16, h + k * kLanes));
  }
};

struct DecodeF32 {
  static constexpr std::size_t kBytes = 4 * kGroup;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    const std::uint8_t* p = row + g * kBytes;
    const float* f = reinterpret_cast<const float*>(p);
    for (std::size_t k = 0; k < kVecs; ++k) w[k] = hn::LoadU(DF(), f + k * kLanes);
  }
};

// The fp16 at p, as a float.
HWY_INLINE float F16At(const std::uint8_t* p) { return fp16_to_float(static_cast<f16>(p[0] | (p[1] << 8))); }

// The 32 bits of a little-endian word at p: bit e belongs to column e (Q5_0, Q5_1).
HWY_INLINE std::uint32_t Word32(const std::uint8_t* p) {
  std::uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Columns [first, first + kLanes) of a 5-bit block: nibble q (low 4 bits) plus bit (first + lane)
// of qh as the fifth.
HWY_INLINE VF FiveBits(hn::Vec<hn::Rebind<std::int32_t, DF>> q, std::uint32_t qh, std::size_t first) {
  const hn::Rebind<std::int32_t, DF> di32;
  const hn::Rebind<std::uint32_t, DF> du32;
  const auto bit = hn::And(hn::Shr(hn::Set(du32, qh), hn::Iota(du32, static_cast<std::uint32_t>(first))), hn::Set(du32, 1));
  return hn::ConvertTo(DF(), hn::Or(q, hn::ShiftLeft<4>(hn::BitCast(di32, bit))));
}

// Q5_0 and Q5_1: d, [m,] qh (32 fifth bits), qs[16] (low nibbles are columns 0..15).
template <bool kOffset>
HWY_INLINE void DecodeFiveBit(const std::uint8_t* p, VF* w) {
  const hn::Rebind<std::uint8_t, DF> du8;
  const hn::Rebind<std::int32_t, DF> di32;
  const VF d = ScaleAt(p);
  const VF m = kOffset ? ScaleAt(p + 2) : hn::Zero(DF());
  const std::uint32_t qh = Word32(p + (kOffset ? 4 : 2));
  const std::uint8_t* qs = p + (kOffset ? 8 : 6);
  const auto low = hn::Set(di32, 0x0F);
  for (std::size_t k = 0; k < 16 / kLanes; ++k) {
    const auto q = hn::PromoteTo(di32, hn::LoadU(du8, qs + k * kLanes));
    const VF lo = FiveBits(hn::And(q, low), qh, k * kLanes), hi = FiveBits(hn::ShiftRight<4>(q), qh, 16 + k * kLanes);
    if (kOffset) {  // w = q·d + m
      w[k] = hn::MulAdd(lo, d, m);
      w[k + 16 / kLanes] = hn::MulAdd(hi, d, m);
    } else {  // w = (q − 16)·d
      const VF sixteen = hn::Set(DF(), 16.0f);
      w[k] = hn::Mul(hn::Sub(lo, sixteen), d);
      w[k + 16 / kLanes] = hn::Mul(hn::Sub(hi, sixteen), d);
    }
  }
}

struct DecodeQ5_0 {  // d, qh, qs[16]
  static constexpr std::size_t kBytes = 22;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    DecodeFiveBit<false>(row + g * kBytes, w);
  }
};

struct DecodeQ5_1 {  // d, m, qh, qs[16]
  static constexpr std::size_t kBytes = 24;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    DecodeFiveBit<true>(row + g * kBytes, w);
  }
};

struct DecodeBF16 {  // the upper half of a float
  static constexpr std::size_t kBytes = 2 * kGroup;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    const hn::Rebind<std::uint16_t, DF> du16;
    const hn::Rebind<std::uint32_t, DF> du32;
    const std::uint16_t* h = reinterpret_cast<const std::uint16_t*>(row + g * kBytes);
    for (std::size_t k = 0; k < kVecs; ++k)
      w[k] = hn::BitCast(DF(), hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, h + k * kLanes))));
  }
};

struct DecodeIQ4_NL {  // d, qs[16]: w = d·kvalues[q], through a 16-entry table per nibble
  static constexpr std::size_t kBytes = 18;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    const std::uint8_t* p = row + g * kBytes;
    const float d = F16At(p);
    HWY_ALIGN float x[kGroup];
    for (std::size_t j = 0; j < 16; ++j) {
      x[j] = d * static_cast<float>(formats::kIq4nlValues[p[2 + j] & 0x0F]);
      x[j + 16] = d * static_cast<float>(formats::kIq4nlValues[p[2 + j] >> 4]);
    }
    for (std::size_t k = 0; k < kVecs; ++k) w[k] = hn::Load(DF(), x + k * kLanes);
  }
};

// K-quants: 256 columns per super-block, eight groups of 32 with their own scales.
constexpr std::size_t kSuperGroups = 8;

// Q4_K (144 bytes: d, dmin, scales[12], qs[128]) and Q5_K (176 bytes: the same with qh[32] before
// qs): group j takes the low nibbles of 32 qs bytes when even, the high ones when odd, plus bit j of
// each qh byte as a fifth bit; w = (d·scale)·q − dmin·min.
template <bool kFifth>
HWY_INLINE void DecodeK4(const std::uint8_t* row, std::size_t g, VF* w) {
  const hn::Rebind<std::uint8_t, DF> du8;
  const hn::Rebind<std::int32_t, DF> di32;
  const std::uint8_t* b = row + (g / kSuperGroups) * (kFifth ? 176 : 144);
  const std::size_t j = g % kSuperGroups;
  int sc, mn;
  formats::q4_k_scale_min(static_cast<int>(j), b + 4, &sc, &mn);
  const VF d1 = hn::Set(DF(), F16At(b) * static_cast<float>(sc));
  const VF m1 = hn::Set(DF(), F16At(b + 2) * static_cast<float>(mn));
  const std::uint8_t* qh = b + 16;
  const std::uint8_t* qs = b + (kFifth ? 48 : 16) + (j / 2) * 32;
  const int shift = (j % 2) * 4;
  for (std::size_t k = 0; k < kVecs; ++k) {
    auto q = hn::And(hn::ShiftRightSame(hn::PromoteTo(di32, hn::LoadU(du8, qs + k * kLanes)), shift), hn::Set(di32, 0x0F));
    if (kFifth) {
      const auto h = hn::And(hn::ShiftRightSame(hn::PromoteTo(di32, hn::LoadU(du8, qh + k * kLanes)), static_cast<int>(j)),
                             hn::Set(di32, 1));
      q = hn::Or(q, hn::ShiftLeft<4>(h));
    }
    w[k] = hn::MulSub(hn::ConvertTo(DF(), q), d1, m1);
  }
}

struct DecodeQ4_K {
  static constexpr std::size_t kBytes = 144 / kSuperGroups;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) { DecodeK4<false>(row, g, w); }
};

struct DecodeQ5_K {
  static constexpr std::size_t kBytes = 176 / kSuperGroups;
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) { DecodeK4<true>(row, g, w); }
};

// Q6_K (210 bytes: ql[128], qh[64], scales[16] int8, d): group j is quarter j % 4 of half j / 4;
// its 6-bit codes take the low (quarters 0, 1) or high (2, 3) nibbles of 32 ql bytes and bits
// 2·quarter of 32 qh bytes; columns 0..15 and 16..31 have their own scale; w = (d·scale)·(q − 32).
struct DecodeQ6_K {
  static constexpr std::size_t kBytes = 26;  // 210 / 8, rounded down
  static HWY_INLINE void Decode(const std::uint8_t* row, std::size_t g, VF* w) {
    const hn::Rebind<std::uint8_t, DF> du8;
    const hn::Rebind<std::int32_t, DF> di32;
    const std::uint8_t* b = row + (g / kSuperGroups) * 210;
    const std::size_t j = g % kSuperGroups, half = j / 4, quarter = j % 4;
    const std::uint8_t* ql = b + 64 * half + 32 * (quarter % 2);
    const std::uint8_t* qh = b + 128 + 32 * half;
    const std::int8_t* sc = reinterpret_cast<const std::int8_t*>(b + 192) + 8 * half + 2 * quarter;
    const float d = F16At(b + 208);
    const VF s0 = hn::Set(DF(), d * static_cast<float>(sc[0])), s1 = hn::Set(DF(), d * static_cast<float>(sc[1]));
    const int nibble = quarter >= 2 ? 4 : 0, field = 2 * static_cast<int>(quarter);
    for (std::size_t k = 0; k < kVecs; ++k) {
      const auto lo = hn::And(hn::ShiftRightSame(hn::PromoteTo(di32, hn::LoadU(du8, ql + k * kLanes)), nibble),
                              hn::Set(di32, 0x0F));
      const auto hi = hn::And(hn::ShiftRightSame(hn::PromoteTo(di32, hn::LoadU(du8, qh + k * kLanes)), field),
                              hn::Set(di32, 3));
      const VF q = hn::ConvertTo(DF(), hn::Sub(hn::Or(lo, hn::ShiftLeft<4>(hi)), hn::Set(di32, 32)));
      w[k] = hn::Mul(q, k * kLanes < 16 ? s0 : s1);
    }
  }
};

// R rows × T tokens: each group of a row is decoded once and multiplied into all T tokens.
// out[i·T + t] = W[row i] · X[token t].
template <class Dec, std::size_t R, std::size_t T>
HWY_INLINE void MultiplyTile(const std::uint8_t* const* rows, const float* const* xs, std::size_t groups,
                             std::size_t ahead, float* out) {
  const DF df;
  VF acc[R][T];
  for (std::size_t i = 0; i < R; ++i)
    for (std::size_t t = 0; t < T; ++t) acc[i][t] = hn::Zero(df);
  for (std::size_t g = 0; g < groups; ++g) {
    VF w[R][kVecs];
    for (std::size_t i = 0; i < R; ++i) {
      hwy::Prefetch(rows[i] + ahead + g * Dec::kBytes);
      Dec::Decode(rows[i], g, w[i]);
    }
    // Each token's vector is loaded once for all R rows.
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t k = 0; k < kVecs; ++k) {
        const VF x = hn::LoadU(df, xs[t] + g * kGroup + k * kLanes);
        for (std::size_t i = 0; i < R; ++i) acc[i][t] = hn::MulAdd(w[i][k], x, acc[i][t]);
      }
  }
  for (std::size_t i = 0; i < R; ++i)
    for (std::size_t t = 0; t < T; ++t) out[i * T + t] = hn::GetLane(hn::SumOfLanes(df, acc[i][t]));
}

// Tile shapes (rows × tokens). Several tokens share each decoded block (prefill, batched decode):
// 2 × 8 while 8 tokens remain, then 4 × 4, where there are 32 vector registers; 1 × 8 and 2 × 4 on
// x86 before AVX-512 (16 registers; more accumulators spill). The decode of a block, not the
// multiply-adds, dominates a tile of 4 tokens: 8 halve its share. A single token spreads over
// four rows so the accumulators form independent chains (decode). Every shape sums a (row, token)
// product in the same order, so a token's result does not depend on its tile.
#if HWY_ARCH_X86 && HWY_TARGET != HWY_AVX3 && HWY_TARGET != HWY_AVX3_DL
constexpr std::size_t kLongRows = 1, kWideRows = 2;
#else
constexpr std::size_t kLongRows = 2, kWideRows = 4;
#endif
constexpr std::size_t kLongTokens = 8, kWideTokens = 4, kNarrowRows = 4;
// Rows that sweep one token tile of X before the next tile starts, so the tile stays in cache.
constexpr std::int64_t kRowBlock = 16;
// Weights are fetched this many rows ahead: the hardware prefetcher alone leaves a matrix that
// streams from memory (decode) at about half the bandwidth.
constexpr std::size_t kPrefetchRows = 16;

struct Problem {
  const std::uint8_t* w;
  std::size_t row_bytes;
  std::int64_t rows, cols;
  const float* x;
  std::int64_t tokens;
  float* y;
};

// Tokens [t0, t0 + T) against rows [r0, r1) in tiles of R rows. A tile that runs past the end
// repeats the last row or token and drops those results, so every tile has the full shape.
template <class Dec, std::size_t R, std::size_t T>
void Pass(const Problem& p, std::int64_t r0, std::int64_t r1, std::int64_t t0) {
  const float* xs[T];
  for (std::size_t t = 0; t < T; ++t)
    xs[t] = p.x + std::min<std::int64_t>(t0 + static_cast<std::int64_t>(t), p.tokens - 1) * p.cols;
  for (std::int64_t r = r0; r < r1; r += R) {
    const std::uint8_t* rows[R];
    for (std::size_t i = 0; i < R; ++i)
      rows[i] = p.w + std::min<std::int64_t>(r + static_cast<std::int64_t>(i), r1 - 1) * p.row_bytes;
    float out[R * T];
    MultiplyTile<Dec, R, T>(rows, xs, static_cast<std::size_t>(p.cols) / kGroup, kPrefetchRows * p.row_bytes, out);
    for (std::size_t i = 0; i < R && r + static_cast<std::int64_t>(i) < r1; ++i)
      for (std::size_t t = 0; t < T && t0 + static_cast<std::int64_t>(t) < p.tokens; ++t)
        p.y[(t0 + t) * p.rows + r + i] = out[i * T + t];
  }
}

template <class Dec>
void MultiplyRows(const Problem& p, std::int64_t begin, std::int64_t end) {
  for (std::int64_t r0 = begin; r0 < end; r0 += kRowBlock) {
    const std::int64_t r1 = std::min(end, r0 + kRowBlock);
    for (std::int64_t t0 = 0; t0 < p.tokens;) {
      if (p.tokens - t0 >= static_cast<std::int64_t>(kLongTokens)) {
        Pass<Dec, kLongRows, kLongTokens>(p, r0, r1, t0);
        t0 += kLongTokens;
      } else if (p.tokens - t0 >= 2) {
        Pass<Dec, kWideRows, kWideTokens>(p, r0, r1, t0);
        t0 += kWideTokens;
      } else {
        Pass<Dec, kNarrowRows, 1>(p, r0, r1, t0);
        t0 += 1;
      }
    }
  }
}

float Dot(const float* a, const float* b, std::int64_t n) {
  const DF df;
  VF acc = hn::Zero(df);
  std::int64_t i = 0;
  for (; i + static_cast<std::int64_t>(kLanes) <= n; i += kLanes)
    acc = hn::MulAdd(hn::LoadU(df, a + i), hn::LoadU(df, b + i), acc);
  float sum = hn::GetLane(hn::SumOfLanes(df, acc));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Every other type: dequantize the row once, then dot it with each token.
void MultiplyRowsGeneric(const Problem& p, GgmlType type, std::int64_t begin, std::int64_t end) {
  std::vector<float> row(static_cast<std::size_t>(p.cols));
  for (std::int64_t r = begin; r < end; ++r) {
    formats::dequantize_row(type, p.w + r * p.row_bytes, row.data(), p.cols);
    for (std::int64_t t = 0; t < p.tokens; ++t) p.y[t * p.rows + r] = Dot(row.data(), p.x + t * p.cols, p.cols);
  }
}

// Rows [begin, end) of Y = X·Wᵀ.
void MatmulRows(const WeightMatrix& w, const float* x, std::int64_t tokens, float* y, std::int64_t begin,
                std::int64_t end) {
  const Problem p = {
      static_cast<const std::uint8_t*>(w.data), formats::ggml_row_bytes(w.type, w.cols), w.rows, w.cols, x, tokens, y};
  if (p.cols % kGroup == 0) {
    switch (w.type) {
      case GgmlType::Q4_0: return MultiplyRows<DecodeQ4_0>(p, begin, end);
      case GgmlType::Q4_1: return MultiplyRows<DecodeQ4_1>(p, begin, end);
      case GgmlType::Q8_0: return MultiplyRows<DecodeQ8_0>(p, begin, end);
      case GgmlType::Q5_0: return MultiplyRows<DecodeQ5_0>(p, begin, end);
      case GgmlType::Q5_1: return MultiplyRows<DecodeQ5_1>(p, begin, end);
      case GgmlType::IQ4_NL: return MultiplyRows<DecodeIQ4_NL>(p, begin, end);
      case GgmlType::Q4_K: return MultiplyRows<DecodeQ4_K>(p, begin, end);
      case GgmlType::Q5_K: return MultiplyRows<DecodeQ5_K>(p, begin, end);
      case GgmlType::Q6_K: return MultiplyRows<DecodeQ6_K>(p, begin, end);
      case GgmlType::F16: return MultiplyRows<DecodeF16>(p, begin, end);
      case GgmlType::BF16: return MultiplyRows<DecodeBF16>(p, begin, end);
      case GgmlType::F32: return MultiplyRows<DecodeF32>(p, begin, end);
      default: break;
    }
  }
  MultiplyRowsGeneric(p, w.type, begin, end);
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::model
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace witcert::model {

HWY_EXPORT(MatmulRows);

namespace {

// Validates the matrix and returns its row size in bytes.
std::size_t checked_row_bytes(const WeightMatrix& w) {
  const formats::GgmlTypeInfo* info = formats::ggml_type_info(w.type);
  if (!info || !info->dequantizable)
    throw std::invalid_argument("matmul: no dequantization for tensor type id " +
                                std::to_string(static_cast<std::uint32_t>(w.type)));
  if (w.rows < 0) throw std::invalid_argument("matmul: negative row count " + std::to_string(w.rows));
  return formats::ggml_row_bytes(w.type, w.cols);
}

}  // namespace

void matmul(const WeightMatrix& w, const float* x, std::int64_t tokens, float* y, ThreadPool& pool) {
  checked_row_bytes(w);
  if (tokens <= 0) return;
  const auto rows = [&](std::int64_t begin, std::int64_t end, int) {
    HWY_DYNAMIC_DISPATCH(MatmulRows)(w, x, tokens, y, begin, end);
  };
  pool.parallel_for(w.rows, std::cref(rows));  // a std::function holds a reference without allocating
}

void matmul_reference(const WeightMatrix& w, const float* x, std::int64_t tokens, float* y) {
  const std::size_t row_bytes = checked_row_bytes(w);
  std::vector<float> row(static_cast<std::size_t>(w.cols));
  for (std::int64_t r = 0; r < w.rows; ++r) {
    formats::dequantize_row(w.type, static_cast<const std::uint8_t*>(w.data) + r * row_bytes, row.data(), w.cols);
    for (std::int64_t t = 0; t < tokens; ++t) {
      double sum = 0.0;
      for (std::int64_t i = 0; i < w.cols; ++i) sum += static_cast<double>(row[i]) * x[t * w.cols + i];
      y[t * w.rows + r] = static_cast<float>(sum);
    }
  }
}

void embedding_row(const WeightMatrix& w, std::int64_t row, float* out) {
  const std::size_t row_bytes = checked_row_bytes(w);
  if (row < 0 || row >= w.rows)
    throw std::out_of_range("embedding row " + std::to_string(row) + " outside [0, " + std::to_string(w.rows) + ")");
  formats::dequantize_row(w.type, static_cast<const std::uint8_t*>(w.data) + row * row_bytes, out, w.cols);
}

}  // namespace witcert::model
#endif  // HWY_ONCE
