// The kernel's vocabulary (included per target after hwy/highway.h): vector types and tile
// constants, lane reductions and transposes, fp16 conversion, and the helpers that put a tile's
// tokens in SIMD lanes.
#if defined(WITCERT_KERNEL_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_SIMD_INL_H_
#undef WITCERT_KERNEL_SIMD_INL_H_
#else
#define WITCERT_KERNEL_SIMD_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention/reference/certified_attention.h"
#include "attention/cpu/load_f16-inl.h"
#include "base/fp16.h"
#include "hwy/highway.h"
#include "formats/dither/dither.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using attention::BoundContext;
using attention::HeadPartial;
using attention::HWY_NAMESPACE::LoadF16;

using DD = hn::ScalableTag<double>;
using VD = hn::Vec<DD>;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using DFH = hn::Rebind<float, DD>;  // as many floats as a vector has doubles
using DI = hn::Repartition<std::int32_t, DF>;
using VI = hn::Vec<DI>;
constexpr std::size_t kN = hn::MaxLanes(DD());
constexpr std::size_t kNF = hn::MaxLanes(DF());
constexpr int kTile = 128;  // positions per tile: one page, or several for float tiles (Run)
constexpr int kGroup = formats::kDefaultGroup;
constexpr int kChains = 4;  // independent FMA chains per head of a code dot (kGroup / kChains + 2 roundings)
constexpr int kHeadBlock = 4;  // query heads that share one pass over a tile's value rows
// Query heads that share one pass over a tile's key codes: their NH·kChains accumulators stay in
// registers (32 vector registers from AVX-512 on, 16 below).
constexpr int kCodeHeads = kNF >= 16 ? 7 : 4;
// Query heads that share one pass over a tile's dither-int8 value codes, and the column blocks of a
// pass for NH of them: NH·K accumulators and K converted codes in registers.
constexpr bool kValueCodes = kNF >= 16;  // below, the K·kNF columns of a pass span less than a group
constexpr int kValueHeads = kCodeHeads;
constexpr std::size_t ValueColumns(int nh) {
  if (kNF >= 16) return nh <= 4 ? 4 : 2;
  return nh <= 2 ? 4 : 2;
}
constexpr double kInf = std::numeric_limits<double>::infinity();
// Q_g of a page (SharedDither): kQChunks vectors of a group's channels in kQChains FMA chains, the
// chains summed pairwise, then the lanes (log2 kNF); at most kQgRoundings roundings a term.
constexpr int Log2(std::size_t x) { return x > 1 ? 1 + Log2(x / 2) : 0; }
constexpr int kQChunks = static_cast<int>(kGroup / kNF);
constexpr int kQChains = kQChunks + Log2(kNF) <= kGroup / kChains + 2 ? 1 : std::min(kChains, kQChunks);
constexpr int kQgRoundings = (kQChunks + kQChains - 1) / kQChains + Log2(kQChains) + Log2(kNF);
static_assert(kGroup % kNF == 0 && (kQChains & (kQChains - 1)) == 0 && kQgRoundings <= kGroup / kChains + 2);


// Lane i of the result is the sum of the lanes of v[i] (as many vectors as lanes; pairwise sums of
// adjacent lanes, which keep the vectors' order).
template <class D = DD>
HWY_INLINE hn::Vec<D> TransposeSum(hn::Vec<D>* v) {
#if HWY_TARGET != HWY_SCALAR
  const D d;
  for (std::size_t width = hn::MaxLanes(d); width > 1; width /= 2)
    for (std::size_t i = 0; i < width / 2; ++i)
      v[i] = hn::Add(hn::ConcatEven(d, v[2 * i + 1], v[2 * i]), hn::ConcatOdd(d, v[2 * i + 1], v[2 * i]));
#endif
  return v[0];
}

// v: K vectors of K-interleaved floats (element e of their concatenation is channel e mod K of
// token e / K); channel ch of the kNF tokens goes to out[ch·step]. K a power of two; even and odd
// channels are split apart log2(K) times, all in registers.
template <int K>
HWY_INLINE void Deinterleave(VF* v, VF* out, int step) {
  if constexpr (K == 1) {
    out[0] = v[0];
  } else {
#if HWY_TARGET == HWY_SCALAR
    for (int ch = 0; ch < K; ++ch) out[ch * step] = v[ch];  // one token: v is its channels
#else
    const DF df;
    VF even[K / 2], odd[K / 2];
    for (int i = 0; i < K / 2; ++i) {
      even[i] = hn::ConcatEven(df, v[2 * i + 1], v[2 * i]);
      odd[i] = hn::ConcatOdd(df, v[2 * i + 1], v[2 * i]);
    }
    Deinterleave<K / 2>(even, out, 2 * step);
    Deinterleave<K / 2>(odd, out + step, 2 * step);
#endif
  }
}

// f.operator()<K>() for K = k a power of two up to 16; false (nothing called) for any other k.
template <class F>
HWY_INLINE bool WithPowerOfTwo(int k, F&& f) {
  switch (k) {
    case 1: f.template operator()<1>(); return true;
    case 2: f.template operator()<2>(); return true;
    case 4: f.template operator()<4>(); return true;
    case 8: f.template operator()<8>(); return true;
    case 16: f.template operator()<16>(); return true;
    default: return false;
  }
}

// The sum of kChains FMA chains, pairwise (log2(kChains) roundings).
template <class V>
HWY_INLINE V SumChains(const V* a) {
  static_assert(kChains == 4);
  return hn::Add(hn::Add(a[0], a[1]), hn::Add(a[2], a[3]));
}

// kN lanes of doubles, or of floats taken exactly as doubles.
template <class T>
HWY_INLINE VD LoadDouble(const T* p) {
  if constexpr (std::is_same_v<T, float>)
    return hn::PromoteTo(DD(), hn::LoadU(DFH(), p));
  else
    return hn::LoadU(DD(), p);
}

// Lane i: q · row i, for kN rows of dp doubles `stride` apart.
// Rows of floats are taken exactly, as double: the same sums as of their double copies.
template <class T>
HWY_INLINE VD DotRows(const double* q, const T* rows, std::size_t stride, std::size_t dp) {
  const DD dd;
  VD acc[kN];
  for (VD& a : acc) a = hn::Zero(dd);
  for (std::size_t c = 0; c < dp; c += kN) {
    const VD qv = hn::LoadU(dd, q + c);
    for (std::size_t i = 0; i < kN; ++i) {
      const VD x = LoadDouble(rows + i * stride + c);
      acc[i] = hn::MulAdd(qv, x, acc[i]);
    }
  }
  return TransposeSum(acc);
}

// Lane i: ‖row i‖² for kN rows of dp doubles (D = double) or floats (D = float, taken exactly).
template <class T>
HWY_INLINE VD SquaredNorms(const T* rows, std::size_t stride, std::size_t dp) {
  const DD dd;
  VD acc[kN];
  for (VD& a : acc) a = hn::Zero(dd);
  for (std::size_t c = 0; c < dp; c += kN)
    for (std::size_t i = 0; i < kN; ++i) {
      const VD x = LoadDouble(rows + i * stride + c);
      acc[i] = hn::MulAdd(x, x, acc[i]);
    }
  return TransposeSum(acc);
}

// A vector of kNF int32 lanes whose sum is Σ_{c<kGroup} code_c², the squares of one group of int8
// codes (below 2^24). Pairs of squares come from one widening multiply-add of int16 lanes.
HWY_INLINE VI CodeSquares(const std::int8_t* codes) {
  const DI di;
#if HWY_TARGET == HWY_SCALAR
  VI sq = hn::Zero(di);
  for (int c = 0; c < kGroup; ++c) sq = hn::Add(sq, hn::Set(di, codes[c] * codes[c]));
  return sq;
#else
  static_assert(kGroup % (2 * kNF) == 0);
  const hn::Repartition<std::int16_t, DF> d16;
  const hn::Rebind<std::int8_t, decltype(d16)> d8;
  VI sq = hn::Zero(di), sq1 = hn::Zero(di);  // sq1: where a target puts the odd products (not x86)
  for (std::size_t k = 0; k < kGroup / (2 * kNF); ++k) {  // a fixed count: unrolled
    const auto x = hn::PromoteTo(d16, hn::LoadU(d8, codes + k * 2 * kNF));
    sq = hn::ReorderWidenMulAccumulate(di, x, x, sq, sq1);
  }
  return hn::Add(sq, sq1);
#endif
}

// Tokens [j0, j0 + kNF) of src ([t][channels], rows up to a whole lane block) with the tokens in
// lanes: channel ch into dst + ch·stride. Split in registers where the channel count is a power
// of two up to 16, gathered otherwise.
void SplitChannels(const float* src, int channels, int j0, float* dst, std::size_t stride) {
  const DF df;
  const hn::Rebind<std::int32_t, DF> di32;
  const bool done = WithPowerOfTwo(channels, [&]<int K>() {
    VF v[K], out[K];
    for (int i = 0; i < K; ++i) v[i] = hn::LoadU(df, src + j0 * K + i * static_cast<int>(kNF));
    Deinterleave<K>(v, out, 1);
    for (int ch = 0; ch < K; ++ch) hn::StoreU(out[ch], df, dst + ch * stride);
  });
  if (!done) {
    const auto rows = hn::Mul(hn::Iota(di32, j0), hn::Set(di32, channels));
    for (int ch = 0; ch < channels; ++ch)
      hn::StoreU(hn::GatherIndex(df, src, hn::Add(rows, hn::Set(di32, ch))), df, dst + ch * stride);
  }
}

// Rows n .. (n rounded up to a lane block) − 1 of src ([t][channels]) repeat row n − 1.
void PadRows(float* src, int channels, int n) {
  for (int t = n; t < static_cast<int>(hwy::RoundUpTo(static_cast<std::size_t>(n), kNF)); ++t)
    std::copy_n(src + (n - 1) * channels, channels, src + t * channels);
}

// f.operator()<nh>() for 1 ≤ nh ≤ kMax: a head count known at compile time (the passes that
// share one load among several query heads keep NH accumulators each).
template <int kMax, class F>
void WithHeads(int nh, F&& f) {
  if constexpr (kMax > 1)
    if (nh < kMax) return WithHeads<kMax - 1>(nh, f);
  f.template operator()<kMax>();
}

// max(0, max_{t<n}(a_t + b_t)) (b may be null), a NaN term left out as std::max leaves it.
double MaxOfSums(const double* a, const double* b, int n) {
  const DD dd;
  VD mx = hn::Zero(dd);
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
    VD x = hn::LoadU(dd, a + j0);
    if (b != nullptr) x = hn::Add(x, hn::LoadU(dd, b + j0));
    const auto keep = hn::And(hn::FirstN(dd, static_cast<std::size_t>(n - j0)), hn::Not(hn::IsNaN(x)));
    mx = hn::Max(mx, hn::IfThenElseZero(keep, x));
  }
  return hn::GetLane(hn::MaxOfLanes(dd, mx));
}

void F16ToDouble(const f16* src, int n, double* out) {
  const DD dd;
  int c = 0;
  for (; c + static_cast<int>(kN) <= n; c += static_cast<int>(kN))
    hn::StoreU(hn::PromoteTo(dd, LoadF16(DFH(), src + c)), dd, out + c);
  for (; c < n; ++c) out[c] = fp16_to_float(src[c]);
}

void F16ToFloat(const f16* src, int n, float* out) {
  const DF df;
  int c = 0;
  for (; c + static_cast<int>(kNF) <= n; c += static_cast<int>(kNF)) hn::StoreU(LoadF16(df, src + c), df, out + c);
  for (; c < n; ++c) out[c] = fp16_to_float(src[c]);
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_SIMD_INL_H_
