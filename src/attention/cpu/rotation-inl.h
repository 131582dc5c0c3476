// rot-4bit's SIMD decoder (included per target after hwy/highway.h): one token's rtn-int4 bytes of
// the rotated y = R·x back to x̂ = Rᵀ·ŷ = D·H_d·ŷ/√d (formats/rotation/hadamard.h), the floats
// formats::KvScheme::decode gives, bit for bit.
//
// Why it is exact. ŷ_c = s_g·q_c with s_g an fp16 scale and q_c ∈ [−8, 7]. Channel c = 32g + 2j + b
// (g the scale group, j the byte, b the nibble); H_d[i][c] = (−1)^popcount(i & c) factors as
// H_G[i/32][g]·H_32[i mod 32][c mod 32], so with P_j = q_{2j} + q_{2j+1} and M_j = q_{2j} − q_{2j+1},
//   X_{32h + 2k + b} = Σ_g H_G[h][g]·s_g·B_{g,b,k},   B_{g,0} = H_16·P,  B_{g,1} = H_16·M,
// where B is an integer of at most 256 in magnitude (exact in float), s_g·B has at most 20
// significant bits (exact in float), and the sum over g is a multiple of 2^-24 below G·2^24:
// exact in double for G ≤ 32 (d ≤ 1024). decode's butterflies in double are exact for the same
// reason, so both reach the exact X_c; both then round X_c·(1/√d) to double, multiply by σ_c = ±1
// and round to float. Every zero on the way is +0 in both (sums of +0 and of x and −x). For d = 64
// (G = 2, 1/√d = 2^-3) one float fused multiply-add rounds X_c once, which the exact scaling by
// 2^-3 and σ_c keeps: the float path below. A non-finite token (s = +inf, every q = 0) decodes to
// the default NaN everywhere, in both.
#if defined(WITCERT_KERNEL_ROTATION_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_ROTATION_INL_H_
#undef WITCERT_KERNEL_ROTATION_INL_H_
#else
#define WITCERT_KERNEL_ROTATION_INL_H_
#endif

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#include "attention/cpu/simd-inl.h"
#include "formats/rotation/hadamard.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

namespace rotation {

constexpr int kMaxDim = 1024;      // the exactness argument's bound on d (G ≤ 32 scale groups)
constexpr int kRecord = 2 + 16;    // bytes of one group's record: [fp16 s][16 bytes of nibbles]
constexpr int kVecs = 16 / static_cast<int>(kNF) > 0 ? 16 / static_cast<int>(kNF) : 1;  // vectors of 16 lanes j
static_assert(16 % kNF == 0);

// σ_c in the order the decoder produces channels: group h, nibble b, byte k (channel 32h + 2k + b).
inline const float* PermutedSigns() {
  static const std::array<float, kMaxDim> table = [] {
    std::array<float, kMaxDim> t{};
    for (int c = 0; c < kMaxDim; ++c) t[(c / 32) * 32 + (c % 2) * 16 + (c % 32) / 2] = static_cast<float>(formats::rotation_sign(c));
    return t;
  }();
  return table.data();
}

// v with lane l swapped with lane l ^ kStep (kStep < kNF, a power of two; never on HWY_SCALAR's
// one lane).
template <int kStep>
HWY_INLINE VF SwapLanes(VF v) {
#if HWY_TARGET == HWY_SCALAR
  return v;
#else
  const DF df;
  if constexpr (kStep == static_cast<int>(kNF) / 2) {
    return hn::ConcatLowerUpper(df, v, v);
  } else if constexpr (kStep == 1) {
    return hn::Reverse2(df, v);
  } else if constexpr (kStep == 2) {
    return hn::Shuffle1032(v);
  } else {
    static_assert(kStep == 4 && kNF == 16);
    return hn::SwapAdjacentBlocks(v);
  }
#endif
}

// H_16 over the 16 lanes j of v (kVecs vectors, j = vector·kNF + lane) in place: the butterfly of
// index bit kStep inside a vector (a·1 + b on the lower lane, b·(−1) + a on the upper) or across
// vectors. Integer values throughout, exact.
template <int kStep>
HWY_INLINE void Stage(VF* v) {
  if constexpr (kStep < static_cast<int>(kNF)) {
    const DF df;
    const hn::Rebind<std::int32_t, DF> di32;
    const auto upper = hn::RebindMask(df, hn::TestBit(hn::Iota(di32, 0), hn::Set(di32, kStep)));
    const VF sign = hn::IfThenElse(upper, hn::Set(df, -1.0f), hn::Set(df, 1.0f));
    for (int i = 0; i < kVecs; ++i) v[i] = hn::MulAdd(sign, v[i], SwapLanes<kStep>(v[i]));
  } else {
    constexpr int kAcross = kStep / static_cast<int>(kNF);
    for (int i = 0; i < kVecs; ++i)
      if ((i & kAcross) == 0) {
        const VF a = v[i], b = v[i + kAcross];
        v[i] = hn::Add(a, b);
        v[i + kAcross] = hn::Sub(a, b);
      }
  }
}

HWY_INLINE void Hadamard16(VF* v) {
  Stage<1>(v);
  Stage<2>(v);
  Stage<4>(v);
  Stage<8>(v);
}

// s_g·B_{g,b} of one group's record: sb[b·kVecs + i] holds lanes j = i·kNF + lane.
HWY_INLINE void GroupTransform(const std::uint8_t* r, VF* sb) {
  const DF df;
  const hn::Rebind<std::int32_t, DF> di32;
  const hn::Rebind<std::uint32_t, DF> du32;
  f16 h;
  std::memcpy(&h, r, sizeof h);
  const VF s = hn::Set(df, fp16_to_float(h));
  for (int i = 0; i < kVecs; ++i) {
    const auto bytes = hn::BitCast(di32, hn::PromoteTo(du32, hn::LoadU(hn::Rebind<std::uint8_t, DF>(), r + 2 + i * kNF)));
    const auto lo = hn::And(bytes, hn::Set(di32, 15)), hi = hn::ShiftRight<4>(bytes);
    sb[i] = hn::ConvertTo(df, hn::Sub(hn::Add(lo, hi), hn::Set(di32, 16)));  // P_j: the offsets 8 cancel in pairs
    sb[kVecs + i] = hn::ConvertTo(df, hn::Sub(lo, hi));                       // M_j
  }
  Hadamard16(sb);
  Hadamard16(sb + kVecs);
  for (int i = 0; i < 2 * kVecs; ++i) sb[i] = hn::Mul(sb[i], s);  // exact: 11 × 9 significant bits
}

// Channels 32h + 2k + b of x̂ from their float lanes xb[b·kVecs + i] (k = i·kNF + lane): × σ, then
// the two nibble halves interleaved into channel order.
HWY_INLINE void StoreGroup(const VF* xb, const float* sigma, float* out) {
  const DF df;
  for (int i = 0; i < kVecs; ++i) {
    const VF even = hn::Mul(xb[i], hn::LoadU(df, sigma + i * kNF));
    const VF odd = hn::Mul(xb[kVecs + i], hn::LoadU(df, sigma + 16 + i * kNF));
    hn::StoreInterleaved2(even, odd, df, out + 2 * i * kNF);
  }
}

// d = 64: X = s_0·B_0 ± s_1·B_1 rounded once in float, then × 2^-3 and σ (exact).
HWY_INLINE void Row64(const std::uint8_t* in, float* out) {
  const DF df;
  const float* sigma = PermutedSigns();
  VF b0[2 * kVecs], b1[2 * kVecs], x[2 * kVecs];
  GroupTransform(in, b0);
  GroupTransform(in + kRecord, b1);
  const VF eighth = hn::Set(df, 0.125f);
  for (int i = 0; i < 2 * kVecs; ++i) x[i] = hn::Mul(hn::Add(b0[i], b1[i]), eighth);
  StoreGroup(x, sigma, out);
  for (int i = 0; i < 2 * kVecs; ++i) x[i] = hn::Mul(hn::Sub(b0[i], b1[i]), eighth);
  StoreGroup(x, sigma + 32, out + 32);
}

// Any power of two 32 ≤ d ≤ 1024: X in double, exact, across the G groups by butterflies; then
// X·(1/√d) rounded to double and to float (σ after: the rounding is symmetric), as decode rounds
// it. sb: 32·G floats of scratch, [g][b][k] as GroupTransform leaves them.
HWY_INLINE void RowDouble(const std::uint8_t* in, int d, float* sb, float* out) {
  const DD dd;
  const DF df;
  const int G = d / 32;
  for (int g = 0; g < G; ++g) {
    VF b[2 * kVecs];
    GroupTransform(in + g * kRecord, b);
    for (int i = 0; i < 2 * kVecs; ++i) hn::StoreU(b[i], df, sb + g * 32 + i * kNF);
  }
  const VD norm = hn::Set(dd, 1.0 / std::sqrt(static_cast<double>(d)));  // fwht_orthonormal's factor
  VD x[kMaxDim / 32];
  for (int p = 0; p < 32; p += static_cast<int>(kN)) {
    for (int g = 0; g < G; ++g) x[g] = hn::PromoteTo(dd, hn::LoadU(DFH(), sb + g * 32 + p));
    for (int h = 1; h < G; h *= 2)
      for (int i = 0; i < G; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const VD a = x[j], b = x[j + h];
          x[j] = hn::Add(a, b);
          x[j + h] = hn::Sub(a, b);
        }
    for (int g = 0; g < G; ++g) hn::StoreU(hn::DemoteTo(DFH(), hn::Mul(x[g], norm)), DFH(), sb + g * 32 + p);
  }
  const float* sigma = PermutedSigns();
  for (int g = 0; g < G; ++g) {
    VF xb[2 * kVecs];
    for (int i = 0; i < 2 * kVecs; ++i) xb[i] = hn::LoadU(df, sb + g * 32 + i * kNF);
    StoreGroup(xb, sigma + 32 * g, out + 32 * g);
  }
}

// One token of rot-4bit, d a power of two in [32, kMaxDim].
HWY_INLINE void Row(const std::uint8_t* in, int d, float* out) {
  if (d == 64) return Row64(in, out);
  HWY_ALIGN float sb[kMaxDim];
  RowDouble(in, d, sb, out);
}

}  // namespace rotation

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_ROTATION_INL_H_
