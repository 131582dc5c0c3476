// Format traits of the packed per-token schemes (included per target after hwy/highway.h): one
// SIMD decoder per formats::PackedLayout, from a token's bytes to its d floats. Each gives the floats
// formats::KvScheme::decode gives, bit for bit: every x̂_c is an fp16 scale times a code of at most 8
// significant bits, exact in float (q4_1, q5_1, rtn-2bit and kvquant-4 then add their fp16 offset
// once, which decode does exactly in double and rounds to float once; the product being exact, a
// fused multiply-add rounds the same). rot-4bit's inverse rotation has its own proof
// (rotation-inl.h). The kernel decodes a tile's rows with them instead of calling the black-box
// decode token by token.
#if defined(WITCERT_KERNEL_PACKED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_PACKED_INL_H_
#undef WITCERT_KERNEL_PACKED_INL_H_
#else
#define WITCERT_KERNEL_PACKED_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "base/fp16.h"
#include "hwy/highway.h"
#include "attention/cpu/rotation-inl.h"
#include "attention/cpu/simd-inl.h"
#include "formats/fp8/fp8.h"
#include "formats/ggml/ggml_types.h"
#include "formats/schemes.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

// One token's bytes of a packed scheme to its d floats.
using PackedRowDecoder = void (*)(const std::uint8_t* in, int d, float* out);

namespace packed {

constexpr int kBlock = 32;  // channels per record of every grouped layout

inline float Scale(const std::uint8_t* p) {
  f16 h;
  std::memcpy(&h, p, sizeof h);
  return fp16_to_float(h);
}

// kNF bytes from p as float lanes, unsigned or signed.
HWY_INLINE VF Unsigned(const std::uint8_t* p) {
  const DF df;
  const hn::Rebind<std::int32_t, DF> di32;
  const hn::Rebind<std::uint8_t, DF> du8;
  return hn::ConvertTo(df, hn::BitCast(di32, hn::PromoteTo(hn::RebindToUnsigned<decltype(di32)>(), hn::LoadU(du8, p))));
}
HWY_INLINE VF Signed(const std::uint8_t* p) {
  const DF df;
  const hn::Rebind<std::int32_t, DF> di32;
  const hn::Rebind<std::int8_t, DF> di8;
  return hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(di8, reinterpret_cast<const std::int8_t*>(p))));
}

// kNF bytes from p as uint32 lanes.
HWY_INLINE hn::Vec<hn::Rebind<std::uint32_t, DF>> Bytes(const std::uint8_t* p) {
  const hn::Rebind<std::uint32_t, DF> du32;
  return hn::PromoteTo(du32, hn::LoadU(hn::Rebind<std::uint8_t, DF>(), p));
}

// Lanes of integer codes q to float: s·(q − offset), or s·q + m.
HWY_INLINE VF Affine(hn::Vec<hn::Rebind<std::uint32_t, DF>> q, int offset, float s, const float* m = nullptr) {
  const DF df;
  const hn::Rebind<std::int32_t, DF> di32;
  const VF x = hn::ConvertTo(df, hn::Sub(hn::BitCast(di32, q), hn::Set(di32, offset)));
  return m ? hn::Add(hn::Mul(x, hn::Set(df, s)), hn::Set(df, *m)) : hn::Mul(x, hn::Set(df, s));
}

// Nibble codes with the record's j-th and (j+16)-th channels in the low and high nibble of byte j
// (GGML's q4 and q5 layouts); q5 adds bit j of qh as the fifth bit.
template <bool kFifthBit>
HWY_INLINE void Nibbles(const std::uint8_t* qs, std::uint32_t qh, int offset, float s, const float* m, float* out) {
  const DF df;
  const hn::Rebind<std::uint32_t, DF> du32;
  for (int j = 0; j < kBlock / 2; j += static_cast<int>(kNF)) {
    const auto b = Bytes(qs + j);
    auto lo = hn::And(b, hn::Set(du32, 15u)), hi = hn::ShiftRight<4>(b);
    if constexpr (kFifthBit) {
      const auto bits = hn::Set(du32, qh);
      const auto at = hn::Iota(du32, static_cast<std::uint32_t>(j));
      lo = hn::Or(lo, hn::ShiftLeft<4>(hn::And(bits >> at, hn::Set(du32, 1u))));
      hi = hn::Or(hi, hn::ShiftLeft<4>(hn::And(bits >> hn::Add(at, hn::Set(du32, 16u)), hn::Set(du32, 1u))));
    }
    hn::StoreU(Affine(lo, offset, s, m), df, out + j);
    hn::StoreU(Affine(hi, offset, s, m), df, out + kBlock / 2 + j);
  }
}

inline std::uint32_t U32(const std::uint8_t* p) {
  std::uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// E4M3FN bytes (in uint32 lanes) to their exact floats without a table: the 7 magnitude bits
// placed at the top of a float's exponent and mantissa give 2^-120 times the value (subnormal
// codes land on float subnormals, scaled exactly), so one multiplication by 2^120 re-biases them;
// S.1111.111 is the quiet NaN of that sign, as formats::fp8_e4m3_to_double gives.
HWY_INLINE VF Fp8(hn::Vec<hn::Rebind<std::uint32_t, DF>> b) {
  const DF df;
  const hn::Rebind<std::uint32_t, DF> du32;
  const auto magnitude = hn::ShiftLeft<20>(hn::And(b, hn::Set(du32, 0x7Fu)));
  const VF x = hn::Mul(hn::BitCast(df, magnitude), hn::Set(df, 0x1p120f));
  const VF value = hn::IfThenElse(hn::RebindMask(df, hn::Eq(magnitude, hn::Set(du32, 0x7Fu << 20))),
                                  hn::BitCast(df, hn::Set(du32, 0x7FC00000u)), x);
  return hn::Or(value, hn::BitCast(df, hn::ShiftLeft<24>(hn::And(b, hn::Set(du32, 0x80u)))));
}

// IQ4_NL's 16 bytes of nibble codes to the code book's values of the record's 32 channels
// (channel j in the low nibble of byte j, channel j + 16 in its high nibble): one byte shuffle
// per half where a vector holds 16 bytes.
HWY_INLINE void Iq4nlValues(const std::uint8_t* qs, std::int8_t* q) {
  const std::int8_t* values = formats::kIq4nlValues;
#if HWY_TARGET != HWY_SCALAR
  const hn::Full128<std::uint8_t> du8;
  const hn::Full128<std::int8_t> di8;
  const auto b = hn::LoadU(du8, qs);
  const auto table = hn::LoadU(di8, values);
  hn::Store(hn::TableLookupBytes(table, hn::BitCast(di8, hn::And(b, hn::Set(du8, std::uint8_t{15})))), di8, q);
  hn::Store(hn::TableLookupBytes(table, hn::BitCast(di8, hn::ShiftRight<4>(b))), di8, q + 16);
#else
  for (int j = 0; j < 16; ++j) q[j] = values[qs[j] & 15], q[j + 16] = values[qs[j] >> 4];
#endif
}

// kvquant-4 values: one asymmetric 4-bit record over the token, x̂_c = lo + s·q_c, then its
// outliers written over their channels in order (an index past d, which decode never wrote, is
// skipped).
inline void KvquantToken(const std::uint8_t* in, int d, float* out) {
  const DF df;
  const hn::Rebind<std::uint32_t, DF> du32;
  const hn::Rebind<std::int32_t, DF> di32;
  const float s = Scale(in), lo = Scale(in + 2);
  const VF vs = hn::Set(df, s), vlo = hn::Set(df, lo);
  const std::uint8_t* codes = in + 4;
  int c = 0;
  for (; c + 2 * static_cast<int>(kNF) <= d; c += 2 * static_cast<int>(kNF)) {
    const auto b = Bytes(codes + c / 2);  // channel 2j in the low nibble of byte j
    const VF even = hn::MulAdd(hn::ConvertTo(df, hn::BitCast(di32, hn::And(b, hn::Set(du32, 15u)))), vs, vlo);
    const VF odd = hn::MulAdd(hn::ConvertTo(df, hn::BitCast(di32, hn::ShiftRight<4>(b))), vs, vlo);
    hn::StoreInterleaved2(even, odd, df, out + c);
  }
  for (; c < d; ++c) out[c] = static_cast<float>(double{lo} + double{s} * ((codes[c / 2] >> (4 * (c % 2))) & 15));
  const std::uint8_t* o = codes + (static_cast<std::size_t>(d) * 4 + 7) / 8;
  for (int k = 0; k < std::max(1, d / 100); ++k, o += 4) {
    const int at = o[0] | (o[1] << 8);
    if (at < d) out[at] = Scale(o + 2);
  }
}

template <formats::PackedLayout L>
void Row(const std::uint8_t* in, int d, float* out) {
  using formats::PackedLayout;
  const DF df;
  if constexpr (L == PackedLayout::rot_4bit) {
    rotation::Row(in, d, out);
  } else if constexpr (L == PackedLayout::kvquant4_token) {
    KvquantToken(in, d, out);
  } else if constexpr (L == PackedLayout::fp16) {
    F16ToFloat(reinterpret_cast<const f16*>(in), d, out);
  } else if constexpr (L == PackedLayout::fp8_e4m3 || L == PackedLayout::fp8_e4m3_scaled) {
    const bool scaled = L == PackedLayout::fp8_e4m3_scaled;
    const float s = scaled ? Scale(in) : 1.0f;
    const std::uint8_t* codes = in + (scaled ? 2 : 0);
    int c = 0;
    for (; c + static_cast<int>(kNF) <= d; c += static_cast<int>(kNF)) {
      const VF x = Fp8(Bytes(codes + c));
      hn::StoreU(scaled ? hn::Mul(x, hn::Set(df, s)) : x, df, out + c);
    }
    const float* table = formats::fp8_e4m3_float_table();
    for (; c < d; ++c) out[c] = scaled ? table[codes[c]] * s : table[codes[c]];
  } else {
    for (int g = 0; g < d / kBlock; ++g, out += kBlock) {
      if constexpr (L == PackedLayout::rtn_int8) {
        const std::uint8_t* r = in + g * (2 + kBlock);
        for (int j = 0; j < kBlock; j += static_cast<int>(kNF)) hn::StoreU(Affine(Bytes(r + 2 + j), 128, Scale(r)), df, out + j);
      } else if constexpr (L == PackedLayout::rtn_int4) {
        const std::uint8_t* r = in + g * (2 + kBlock / 2);
        const hn::Rebind<std::uint32_t, DF> du32;
        HWY_ALIGN float lo[kBlock / 2], hi[kBlock / 2];
        for (int j = 0; j < kBlock / 2; j += static_cast<int>(kNF)) {
          const auto b = Bytes(r + 2 + j);
          hn::Store(Affine(hn::And(b, hn::Set(du32, 15u)), 8, Scale(r)), df, lo + j);
          hn::Store(Affine(hn::ShiftRight<4>(b), 8, Scale(r)), df, hi + j);
        }
        for (int j = 0; j < kBlock / 2; ++j) out[2 * j] = lo[j], out[2 * j + 1] = hi[j];  // channel 2j, 2j + 1
      } else if constexpr (L == PackedLayout::q8_0) {
        const std::uint8_t* r = in + g * (2 + kBlock);
        const VF s = hn::Set(df, Scale(r));
        for (int j = 0; j < kBlock; j += static_cast<int>(kNF)) hn::StoreU(hn::Mul(Signed(r + 2 + j), s), df, out + j);
      } else if constexpr (L == PackedLayout::q4_0) {
        const std::uint8_t* r = in + g * (2 + kBlock / 2);
        Nibbles<false>(r + 2, 0, 8, Scale(r), nullptr, out);
      } else if constexpr (L == PackedLayout::q4_1) {
        const std::uint8_t* r = in + g * (4 + kBlock / 2);
        const float m = Scale(r + 2);
        Nibbles<false>(r + 4, 0, 0, Scale(r), &m, out);
      } else if constexpr (L == PackedLayout::q5_0) {
        const std::uint8_t* r = in + g * (6 + kBlock / 2);
        Nibbles<true>(r + 6, U32(r + 2), 16, Scale(r), nullptr, out);
      } else if constexpr (L == PackedLayout::q5_1) {
        const std::uint8_t* r = in + g * (8 + kBlock / 2);
        const float m = Scale(r + 2);
        Nibbles<true>(r + 8, U32(r + 4), 0, Scale(r), &m, out);
      } else if constexpr (L == PackedLayout::iq4_nl) {
        const std::uint8_t* r = in + g * (2 + kBlock / 2);
        HWY_ALIGN std::int8_t q[kBlock];  // the code book's values of channels 0–31
        Iq4nlValues(r + 2, q);
        const VF s = hn::Set(df, Scale(r));
        for (int j = 0; j < kBlock; j += static_cast<int>(kNF)) hn::StoreU(hn::Mul(s, Signed(reinterpret_cast<const std::uint8_t*>(q + j))), df, out + j);
      } else if constexpr (L == PackedLayout::rtn_2bit) {
        const std::uint8_t* r = in + g * (4 + kBlock / 4);
        const hn::Rebind<std::int32_t, DF> di32;
        const hn::Rebind<std::uint32_t, DF> du32;
        const VF s = hn::Set(df, Scale(r)), lo = hn::Set(df, Scale(r + 2));
        for (int j = 0; j < kBlock; j += static_cast<int>(kNF)) {
          // Channels 0–15 in the first word, 16–31 in the second, two bits each.
          const auto word = hn::Set(du32, U32(r + 4 + 4 * (j / 16)));
          const auto q = hn::And(word >> hn::ShiftLeft<1>(hn::Iota(du32, static_cast<std::uint32_t>(j % 16))), hn::Set(du32, 3u));
          hn::StoreU(hn::MulAdd(hn::ConvertTo(df, hn::BitCast(di32, q)), s, lo), df, out + j);
        }
      } else if constexpr (L == PackedLayout::sign_1bit) {
        const std::uint8_t* r = in + g * (2 + kBlock / 8);
        const hn::Rebind<std::uint32_t, DF> du32;
        const VF m = hn::Set(df, Scale(r));
        const auto word = hn::Set(du32, U32(r + 2));
        for (int j = 0; j < kBlock; j += static_cast<int>(kNF)) {
          const auto negative = hn::TestBit(word >> hn::Iota(du32, static_cast<std::uint32_t>(j)), hn::Set(du32, 1u));
          hn::StoreU(hn::IfThenElse(hn::RebindMask(df, negative), hn::Neg(m), m), df, out + j);
        }
      }
    }
  }
}

}  // namespace packed

// The decoder of a layout at head dimension d; nullptr for formats::PackedLayout::opaque, and for
// rot-4bit past the exactness argument's d (rotation::kMaxDim).
inline PackedRowDecoder PackedDecoder(formats::PackedLayout layout, int d) {
  using formats::PackedLayout;
  switch (layout) {
    case PackedLayout::rot_4bit: return d <= rotation::kMaxDim ? packed::Row<PackedLayout::rot_4bit> : nullptr;
    case PackedLayout::rtn_2bit: return packed::Row<PackedLayout::rtn_2bit>;
    case PackedLayout::sign_1bit: return packed::Row<PackedLayout::sign_1bit>;
    case PackedLayout::kvquant4_token: return packed::Row<PackedLayout::kvquant4_token>;
    case PackedLayout::fp16: return packed::Row<PackedLayout::fp16>;
    case PackedLayout::fp8_e4m3: return packed::Row<PackedLayout::fp8_e4m3>;
    case PackedLayout::fp8_e4m3_scaled: return packed::Row<PackedLayout::fp8_e4m3_scaled>;
    case PackedLayout::rtn_int8: return packed::Row<PackedLayout::rtn_int8>;
    case PackedLayout::rtn_int4: return packed::Row<PackedLayout::rtn_int4>;
    case PackedLayout::q8_0: return packed::Row<PackedLayout::q8_0>;
    case PackedLayout::q4_0: return packed::Row<PackedLayout::q4_0>;
    case PackedLayout::q4_1: return packed::Row<PackedLayout::q4_1>;
    case PackedLayout::q5_0: return packed::Row<PackedLayout::q5_0>;
    case PackedLayout::q5_1: return packed::Row<PackedLayout::q5_1>;
    case PackedLayout::iq4_nl: return packed::Row<PackedLayout::iq4_nl>;
    case PackedLayout::opaque: break;
  }
  return nullptr;
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_PACKED_INL_H_
