#include "attn/certified_attention_fast.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "base/fp16.h"
#include "cert/round_up.h"
#include "cert/subgaussian.h"
#include "cert/witness.h"
#include "quant/philox.h"

// The kernel keeps small arrays of vectors, which sizeless vector types (SVE, RVV) do not allow.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attn/certified_attention_fast.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "attn/load_f16-inl.h"

// Soundness of the bound for the logits this kernel uses. Theorem 1 needs c_t ≥ |z̃'_t − z_t| for
// the z̃'_t the softmax actually uses. Keys are decoded exactly into double (s_g·(code − ξ) has at
// most 43 significant bits; scheme and fp16 keys are floats), so z̃'_t differs from sm·q·k̂_t only
// by the rounding of the dot product. Each product passes through at most d + G + 36 ≤ d + 64
// roundings (an FMA chain per lane, the pairwise lane sum, Q_g and the shared-page subtraction of
// Σ_g s_g Q_g, the scaling by sm), so with γ_n = n·2^-53/(1 − n·2^-53)
//   |z̃'_t − sm·q·k̂_t| ≤ sm·γ_{d+64}·(Σ_c |q_c k'_{t,c}| + Σ_g s_g Σ_{c∈g} |q_c ξ_c|),
// and the sum is at most ‖q‖·‖k̂_t‖ (Tier A, Cauchy–Schwarz), or, since |code − ξ| ≤ 127.5 and
// |ξ| ≤ ½, 128·Σ_g s_{g,t}·‖q_g‖₁ + max_{outlier c}|q_c|·Σ_{outlier c}|x_{t,c}| (Tier B, q_g the
// non-outlier channels of group g). η_t = sm·(d + 64)·2^-52 times that sum dominates the bound
// with room for the rounding of η_t itself; the kernel uses c_t = (the reference's Tier A or
// Tier B bound) + η_t. Tokens served exact carry c_t = 0 as in the reference: their logits are the
// reference point of every fp16 path.
//
// Shared-page dither-int8 keys take a float path (the certified cache's default, and the one whose
// speed matters): the tile's codes are converted to float with the tokens in lanes, and per query
// head and group the code sum C_g = Σ_{c∈g} q̄_c·code_{t,c} (q̄: q with the outlier channels
// zeroed) runs in kChains FMA chains; Q_g = Σ_{c∈g} q̄_c·ξ_c (once per page, the channels in lanes)
// takes at most as many roundings (kQgRoundings); then
// z̃'_t = sm·(Σ_{outlier c} q_c x_{t,c} + Σ_g s_g·(C_g − Q_g)) in float. Codes, ξ, scales, outlier
// values and q are exact in float. A term q_c·code_c or q_c·ξ_c passes through at
// most kGroup/kChains (its chain) + 2 (the chains' sum) + 1 (C_g − Q_g) + 1 (·s_g, added to the
// running sum) + (G − 1) (the later groups' additions) + 2 (sm rounded to float, and the product)
// = kGroup/kChains + G + 5 roundings; an outlier term m2 + G + 2. With n the largest of these and
// u = 2^-24,
//   |z̃'_t − sm·q·k̂_t| ≤ γ_n·sm·(Σ_g s_g·Σ_{c∈g}(|q̄_c code_c| + |q̄_c ξ_c|) + Σ_{outlier c}|q_c x_{t,c}|)
//                     ≤ γ_n·sm·(128·Σ_g s_g·‖q̄_g‖₁ + max_{outlier c}|q_c|·Σ_{outlier c}|x_{t,c}|)
// (|code| ≤ 127, |ξ| ≤ ½), γ_n = n·u/(1 − n·u) ≤ n·u·(1 + 2^-16). A float product that underflows
// loses at most 2^-150, covered by sm·(d + 64)·2^-126. That is η_t of this path: about 1e-4 of the
// sub-Gaussian radius at d = 64. With (1 + 2^-17) on both, c_t ≤ a_t + η_t where
// a_t² = Σ_g cq2_g·s_{g,t}² evaluated in float, the factors sm²κ²/12·(1 + 2^-17)² folded into the
// float coefficients cq2_g: 1 + 2^-17 exceeds the relative rounding of the coefficients and of the
// ≤ G + 2 float operations a_t passes through (its square root included), so a_t ≥ u_t. The meter
// takes these tokens through their moments (cert::MeterStats::add_moment): per token and query head
// only a_t, a_t² and three multiply-adds, Σ w_t a_t, Σ w_t a_t² and the value side's Σ w_t ρ^v_t in
// one-signed float chains widened upwards (UpdateFloat); η_t is replaced by a bound η' from the call's largest scale per group
// and largest Σ|x_out| (its coefficients are positive), and c_t ≤ a_t + η' gives
// Σ w_t c_t ≤ Σ w_t a_t + η'·Σ w_t and Σ w_t c_t² ≤ Σ w_t a_t² + 2η'·Σ w_t a_t + η'²·Σ w_t. A larger A
// and a smaller A⁻ than the exact ones only loosen every bound shape. A non-finite scale or outlier
// value makes the logit NaN, which reads as "no guarantee".

// The three LSEs accumulate in double. In the double path every term e^{x_t − m} carries ≤ 1 ulp
// (Highway's Exp), and the running sum takes ≤ 1 rounding per addition and ≤ 3 per rescale, at most
// one rescale per tile: per term no more roundings than the reference's token-by-token
// accumulation, whose total cert::lse_rounding_margin covers. Float tiles compute the weight
// w_t = e^{x_t − m} itself in float (UpdateFloat): its relative error grows with |x_t|, and
// MeterStats::float_c_max carries the allowance for it (cert::float_weight_error).

HWY_BEFORE_NAMESPACE();
namespace witcert::attn {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

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
constexpr int kGroup = quant::kDefaultGroup;
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

// Lane i: q · row i, for kN rows of dp doubles `stride` apart.
HWY_INLINE VD DotRows(const double* q, const double* rows, std::size_t stride, std::size_t dp) {
  const DD dd;
  VD acc[kN];
  for (VD& a : acc) a = hn::Zero(dd);
  for (std::size_t c = 0; c < dp; c += kN) {
    const VD qv = hn::LoadU(dd, q + c);
    for (std::size_t i = 0; i < kN; ++i) acc[i] = hn::MulAdd(qv, hn::LoadU(dd, rows + i * stride + c), acc[i]);
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
      VD x;
      if constexpr (std::is_same_v<T, float>)
        x = hn::PromoteTo(dd, hn::LoadU(DFH(), rows + i * stride + c));
      else
        x = hn::LoadU(dd, rows + i * stride + c);
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

// ξ_c = quant::dither_from_bits(word c mod 4 of Philox(counter, c/4, kv_head, layer)), c < d: the
// counters are the SIMD lanes, four channels per lane.
void DitherRow(const quant::DitherStream& s, std::uint32_t counter, int d, float* xi, std::uint32_t* words) {
#if HWY_TARGET == HWY_SCALAR
  (void)words;
  quant::dither_values(s, counter, std::span<float>(xi, d));
#else
  using namespace quant::philox_detail;
  const hn::ScalableTag<std::uint32_t> du;
  const hn::Repartition<std::uint64_t, decltype(du)> du64;
  const hn::RebindToSigned<decltype(du)> di;
  const hn::Rebind<float, decltype(du)> df;
  constexpr std::size_t kL = hn::MaxLanes(du);
  // hi and lo words of a·m per lane, from the 64-bit products of the even and the odd lanes.
  const auto mul_hi_lo = [&](auto a, std::uint32_t m, auto& hi, auto& lo) {
    const auto mv = hn::Set(du, m);
    const auto even = hn::MulEven(a, mv);
    const auto odd = hn::MulEven(hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(du64, a))), mv);
    hi = hn::OddEven(hn::BitCast(du, odd), hn::BitCast(du, hn::ShiftRight<32>(even)));
    lo = hn::OddEven(hn::BitCast(du, hn::ShiftLeft<32>(odd)), hn::BitCast(du, even));
  };
  for (int j0 = 0; j0 < d / 4; j0 += static_cast<int>(kL)) {
    auto c0 = hn::Set(du, counter), c1 = hn::Iota(du, static_cast<std::uint32_t>(j0));
    auto c2 = hn::Set(du, s.kv_head), c3 = hn::Set(du, s.layer);
    std::uint32_t k0 = static_cast<std::uint32_t>(s.seed), k1 = static_cast<std::uint32_t>(s.seed >> 32);
    for (int round = 0; round < 10; ++round) {
      if (round > 0) k0 += kW0, k1 += kW1;
      decltype(c0) hi0, lo0, hi1, lo1;
      mul_hi_lo(c0, kM0, hi0, lo0);
      mul_hi_lo(c2, kM1, hi1, lo1);
      c0 = hn::Xor(hn::Xor(hi1, c1), hn::Set(du, k0));
      c1 = lo1;
      c2 = hn::Xor(hn::Xor(hi0, c3), hn::Set(du, k1));
      c3 = lo0;
    }
    hn::StoreInterleaved4(c0, c1, c2, c3, du, words + 4 * j0);
  }
  for (int c = 0; c < d; c += static_cast<int>(kL)) {
    const auto top = hn::BitCast(di, hn::ShiftRight<8>(hn::LoadU(du, words + c)));
    hn::StoreU(hn::MulAdd(hn::ConvertTo(df, top), hn::Set(df, 0x1p-24f), hn::Set(df, -0.5f)), df, xi + c);
  }
#endif
}

void DitherValuesFast(const quant::DitherStream& stream, std::uint32_t counter, float* xi, int d) {
  std::vector<std::uint32_t> words(static_cast<std::size_t>(d) + 4 * hn::MaxLanes(hn::ScalableTag<std::uint32_t>()));
  std::vector<float> out(words.size());
  DitherRow(stream, counter, d, out.data(), words.data());
  std::copy_n(out.begin(), d, xi);
}

class FastAttention {
 public:
  FastAttention(cache::KvStore::Reader& reader, const float* q, int group, int d, const BoundContext& ctx, bool meter)
      : r_(reader),
        cfg_(reader.config()),
        q_(q),
        group_(group),
        d_(d),
        dp_(hwy::RoundUpTo(static_cast<std::size_t>(d), kNF)),
        ctx_(ctx),
        meter_(meter),
        k_kind_(reader.kind(quant::KvSide::key)),
        v_kind_(reader.kind(quant::KvSide::value)),
        G_(d / kGroup),
        B_(cfg_.bands),
        m2_(2 * cfg_.outlier_pairs),
        float_keys_(k_kind_ == cache::FormatKind::dither_int8 && cfg_.dither != cache::DitherMode::per_slot) {
    qd_.assign(group_ * dp_, 0.0);
    for (int h = 0; h < group_; ++h)
      for (int c = 0; c < d_; ++c) qd_[h * dp_ + c] = q_[h * d_ + c];
    // η_t per unit of Σ_c |q_c k'_{t,c}|: tiles in double, and tiles of shared-ξ dither-int8 keys in
    // float (the comment at the top).
    const double float_roundings = std::max(kGroup / kChains + G_ + 5, m2_ + G_ + 2);
    const double eta = ctx_.sm * (d_ + 64) * 0x1p-52;
    const double eta_float = ctx_.sm * (float_roundings * 0x1p-24 * (1.0 + 0x1p-16) + (d_ + 64) * 0x1p-52);
    if (float_keys_) {
      eta0_ = ctx_.sm * (dp_ + 64) * 0x1p-126;  // 2^-150 a rounding would do; 2^-126 keeps it a normal float
      const int blocks = (kTile + static_cast<int>(kNF) - 1) / static_cast<int>(kNF);
      code_blocks_.assign(static_cast<std::size_t>(blocks), CodeBlock{});
      tail_codes_.assign(static_cast<std::size_t>(blocks) * d_ * kNF, 0);
      outliers_t_.assign(static_cast<std::size_t>(blocks) * m2_ * kNF, 0.0f);
      code_dots_.assign(static_cast<std::size_t>(group_) * G_ * kTile + kNF, 0.0f);
      meta_f_.assign(static_cast<std::size_t>(kTile) * G_, 0.0f);
      outliers_f_.assign(static_cast<std::size_t>(kTile) * m2_ + 1, 0.0f);
    }
    if (k_kind_ == cache::FormatKind::scheme) {
      const cert::BandLayout bands(d_, B_, cfg_.rope_layout);
      qn_.resize(static_cast<std::size_t>(group_) * B_);
      eta_q_.resize(group_);
      for (int h = 0; h < group_; ++h) {
        cert::band_norms(bands, std::span<const float>(q_ + h * d_, d_), std::span<double>(&qn_[h * B_], B_));
        double norm2 = 0.0;
        for (int c = 0; c < d_; ++c) norm2 += qd_[h * dp_ + c] * qd_[h * dp_ + c];
        eta_q_[h] = eta * std::sqrt(norm2);
      }
    }
    if (k_kind_ == cache::FormatKind::dither_int8) {
      const std::uint8_t* mask = r_.outlier_mask();
      for (int c = 0; c < d_; ++c)
        if (mask[c]) outliers_.push_back(c);
      // ς_t² = (sm²/12)·Σ_g s_{g,t}²·Σ_{c∈g, non-outlier} q_c² (Lemma 2, the sum regrouped by g).
      q2_.assign(static_cast<std::size_t>(group_) * G_, 0.0);
      qbar_.assign(group_ * dp_, 0.0);
      eta_g_.assign(q2_.size(), 0.0);
      eta_x_.assign(group_, 0.0);
      for (int h = 0; h < group_; ++h)
        for (int c = 0; c < d_; ++c) {
          const double qc = qd_[h * dp_ + c];
          if (mask[c]) {
            eta_x_[h] = std::max(eta_x_[h], eta * std::fabs(qc));
            continue;
          }
          q2_[h * G_ + c / kGroup] += qc * qc;
          eta_g_[h * G_ + c / kGroup] += eta * 128.0 * std::fabs(qc);
          qbar_[h * dp_ + c] = qc;
        }
      if (float_keys_) {
        qbar_f_.assign(qbar_.begin(), qbar_.end());
        // Head blocks of CodeDots: block h0 holds nh = min(kCodeHeads, group − h0) heads, [c][nh].
        qbarf_.assign(group_ * dp_, 0.0f);
        for (int h0 = 0; h0 < group_; h0 += kCodeHeads) {
          const int nh = std::min(kCodeHeads, group_ - h0);
          for (int j = 0; j < nh; ++j)
            for (int c = 0; c < d_; ++c) qbarf_[h0 * dp_ + c * nh + j] = static_cast<float>(qbar_[(h0 + j) * dp_ + c]);
        }
        // Before the outlier pairs are fixed (the first calibration_tokens positions) the mask is
        // empty and every key is served exact: q_out_ stays zero.
        q_out_.assign(static_cast<std::size_t>(group_) * m2_, 0.0f);
        for (int h = 0; h < group_; ++h)
          for (std::size_t j = 0; j < outliers_.size(); ++j) q_out_[h * m2_ + j] = q_[h * d_ + outliers_[j]];
      }
      scales_.assign(static_cast<std::size_t>(kTile) * G_, 0.0);
      outlier_values_.assign(static_cast<std::size_t>(kTile) * m2_, 0.0);
      v2_scale_ = ctx_.sm * ctx_.sm / 12.0 * cert::kRoundUpMargin;
      // subgaussian_radius is sqrt(ς²)·κ with κ its value at ς² = 1: evaluated once per call.
      kappa_ = cert::subgaussian_radius(1.0, ctx_.S, ctx_.delta_loc, r_.non_outlier_channels());
      stream_ = r_.dither_stream();
      xi_.assign(dp_ + 4 * kNF, 0.0f);
      key_row_.assign(d_, 0);
      words_.assign(xi_.size(), 0);
      s_.assign(static_cast<std::size_t>(G_) * kTile, 0.0);
      s2_.assign(s_.size(), 0.0);
      if (float_keys_) {
        sf_.assign(static_cast<std::size_t>(G_) * kTile + kNF, 0.0f);
        s2f_.assign(sf_.size(), 0.0f);
        poison_.assign(kTile + kNF, 0.0f);
        tile_s2_max_.assign(G_, 0.0f);
        key_s2_max_.assign(G_, 0.0f);
        x_out_max_.assign(kNF, 0.0f);
        chains_.assign(static_cast<std::size_t>(group_) * kChainCount * kNF, 0.0f);
        chain_steps_.assign(group_, 0);
        chain_a_max_.assign(static_cast<std::size_t>(group_) * kNF, 0.0f);
        l_mixed_.assign(group_, 0);
        const std::size_t segments = kTile / kNF + 1;
        qgf_.assign(segments * group_ * G_, 0.0f);
        page_counter_.assign(segments, -1);
        block_segment_.assign(segments, 0);
        key_meta_buf_.resize(static_cast<std::size_t>(kTile) * G_);
        key_outliers_buf_.resize(static_cast<std::size_t>(kTile) * m2_);
        for (double e : eta_g_) eta_gf_.push_back(static_cast<float>(e * (eta_float / eta)));
        for (double e : eta_x_) eta_xf_.push_back(static_cast<float>(e * (eta_float / eta)));
        // c_t ≤ a_t + η' with a_t = sqrt(Σ_g cq2_g s_g²) (FloatWeights, Radii) and
        // η' = ceta0 + ceta_x·max_t x_out + Σ_g ceta_g·max_t s_g (EtaBound): (sqrt(ς_t²)·κ + η_t)·(1 + 2^-17)
        // up to the rounding of each coefficient to float and of the ≤ G + 2 float operations of a_t
        // (relative 2^-24 each, G + 3 < 128).
        constexpr double up = 1.0 + 0x1p-17;
        for (double q2 : q2_) cq2f_.push_back(static_cast<float>(q2 * v2_scale_ * kappa_ * kappa_ * up * up));
        for (double e : eta_g_) ceta_gf_.push_back(static_cast<float>(e * (eta_float / eta) * up));
        for (double e : eta_x_) ceta_xf_.push_back(static_cast<float>(e * (eta_float / eta) * up));
        ceta0f_ = static_cast<float>(eta0_ * up);
        zf_.assign(static_cast<std::size_t>(group_) * kTile + kNF, 0.0f);
        cf_.assign(zf_.size(), 0.0f);
        z_max_.assign(group_, 0.0);
        xf_.assign(kTile + kNF, 0.0f);
      }
    }
    if (k_kind_ == cache::FormatKind::scheme) {
      w_band_.assign(static_cast<std::size_t>(B_) * kTile, 0.0);
      band_row_.assign(B_, 0.0);
    }
    krows_.assign(kTile * dp_, 0.0);
    kfloat_.assign(dp_, 0.0f);
    vrows_.assign(kTile * dp_, 0.0f);
    v_rho_f_.assign(kTile + kNF, 0.0f);
    if (v_kind_ == cache::FormatKind::dither_int8) {
      v_scalesf_.assign(static_cast<std::size_t>(kTile) * G_, 0.0f);
      v_s_tf_.assign(v_scalesf_.size() + kN, 0.0f);
      rho_factor_ = RhoFactor();
      ws_.assign(static_cast<std::size_t>(kValueHeads) * (4 * kNF / kGroup + 1) * kTile, 0.0f);
      code_sq_.assign(static_cast<std::size_t>(G_) * kTile * kNF, 0.0f);
      code_sum_.assign(static_cast<std::size_t>(G_) * kTile + kNF, 0.0f);
    }
    mu_.assign(kTile, 0.0);
    x_out_.assign(kTile, 0.0);
    rho_.assign(kTile, 0.0);
    vnorm_.assign(kTile, 0.0);
    z_.assign(static_cast<std::size_t>(group_) * kTile, 0.0);
    c_.assign(z_.size(), 0.0);
    w_.assign(z_.size(), 0.0f);
    acc_.assign(group_ * dp_, 0.0);
    rescale_.assign(group_, 1.0);
    finite_.assign(group_, 1);
    pending_.assign(static_cast<std::size_t>(group_) * kPendings * kN, 0.0);
    scalar_.assign(group_, 0);
  }

  void Run(std::int64_t begin, std::int64_t end, std::vector<HeadPartial>& partials) {
    partials.resize(group_);
    for (int h = 0; h < group_; ++h) {
      partials[h].acc.resize(d_, 0.0);
      std::copy_n(partials[h].acc.begin(), d_, &acc_[h * dp_]);
    }
    cache::KvStore::Reader::RawPage page;
    page.end = page.begin = -1;
    int n = 0;
    for (std::int64_t t0 = begin; t0 < end; t0 += n) {
      if (t0 >= page.end) page = r_.raw_page(t0);
      n = static_cast<int>(std::min<std::int64_t>({kTile, end - t0, page.end - t0}));
      const bool k_packed = t0 < page.k.packed_end, v_packed = t0 < page.v.packed_end;
      if (k_packed) n = static_cast<int>(std::min<std::int64_t>(n, page.k.packed_end - t0));
      if (v_packed) n = static_cast<int>(std::min<std::int64_t>(n, page.v.packed_end - t0));
      shared_tile_ = t0 < page.shared_end;  // a tile's keys share one ξ, or each has its own
      if (shared_tile_) n = static_cast<int>(std::min<std::int64_t>(n, page.shared_end - t0));
      float_tile_ = float_keys_ && k_packed && shared_tile_;
      segments_.assign(1, Segment{page, static_cast<std::size_t>(t0 - page.begin), 0, n});
      if (float_tile_ && v_packed && v_kind_ == cache::FormatKind::dither_int8) n = ExtendTile(t0, end, n, page);
      const RawPage& first = segments_[0].page;  // the tile's first page (page: its last)
      LoadKeys(first, t0, n, k_packed);
      if (float_tile_) AllCodeDots(n);
      for (int h = 0; h < group_; ++h) Logits(h, n);
      LoadValues(first, t0, n, v_packed);
      bool any_scalar = false;
      for (int h = 0; h < group_; ++h) {
        scalar_[h] = !finite_[h] || !Clean(partials[h]);
        any_scalar = any_scalar || scalar_[h];
      }
      if (any_scalar && meter_) ValueNorms();  // ScalarTile reads ‖v̂_t‖
      for (int h = 0; h < group_; ++h) {
        HeadPartial& p = partials[h];
        if (scalar_[h]) {
          Flush(h, p);
          ScalarTile(h, n, p);
        } else {
          Update(h, n, p);
        }
      }
      AccumulateAll(n);
      if (meter_) {  // max_t (‖v̂_t‖ + ρ^v_t) of the heads that did not take ScalarTile
        double v_max = stored_v_max_;
        if (!(v_max >= 0.0)) {
          ValueNorms();
          RhoDouble();
          v_max = MaxOfSums(vnorm_.data(), rho_.data(), n);
        }
        for (int h = 0; h < group_; ++h)
          if (!scalar_[h]) partials[h].v_max = std::max(partials[h].v_max, v_max);
      }
    }
    for (int h = 0; h < group_; ++h) {
      Flush(h, partials[h]);
      std::copy_n(&acc_[h * dp_], d_, partials[h].acc.begin());
    }
  }

 private:
  using KeyKind = cache::KeyBound::Kind;
  using RawPage = cache::KvStore::Reader::RawPage;

  // A float tile goes on into the following pages while it has filled whole lane blocks (so that no
  // block straddles two pages) and they are packed on both sides and share their page's ξ: the
  // per-tile work (softmax bookkeeping, the output's double accumulators) is then shared by up to
  // kTile tokens. Each page is a segment; page ends up as the last one.
  int ExtendTile(std::int64_t t0, std::int64_t end, int n, RawPage& page) {
    while (n < kTile && n % static_cast<int>(kNF) == 0 && t0 + n < end) {
      const std::int64_t at = t0 + n;
      const RawPage next = r_.raw_page(at);
      const std::int64_t stop =
          std::min<std::int64_t>({next.end, end, t0 + kTile, next.k.packed_end, next.v.packed_end, next.shared_end});
      if (stop <= at) break;
      page = next;
      segments_.push_back(Segment{page, static_cast<std::size_t>(at - page.begin), n, static_cast<int>(stop - at)});
      n = static_cast<int>(stop - t0);
    }
    return n;
  }

  // --- Keys: double rows k'_t, and what bounds their logit error, in token lanes.

  void LoadKeys(const cache::KvStore::Reader::RawPage& page, std::int64_t t0, int n, bool packed) {
    const std::size_t row0 = static_cast<std::size_t>(t0 - page.begin);
    if (!packed) {
      key_kind_ = KeyKind::exact;
      for (int i = 0; i < n; ++i) F16ToDouble(page.k.exact + (row0 + i) * d_, d_, &krows_[i * dp_]);
      return;
    }
    if (k_kind_ == cache::FormatKind::scheme) {
      key_kind_ = KeyKind::tier_a;
      key_meta_ = page.k.meta + row0 * B_;
      const quant::KvScheme& scheme = *r_.scheme(quant::KvSide::key);
      for (int i = 0; i < n; ++i) {
        DecodeScheme(scheme, quant::KvSide::key, page.k.packed, row0 + i, t0 + i, kfloat_.data(), k_block_);
        FloatRow(kfloat_.data(), &krows_[i * dp_]);
        if (!meter_) continue;
        F16ToDouble(key_meta_ + i * B_, B_, band_row_.data());
        for (int b = 0; b < B_; ++b) w_band_[b * kTile + i] = band_row_[b];
      }
      if (!meter_) return;
      const DD dd;
      for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN))
        hn::StoreU(hn::Sqrt(SquaredNorms(&krows_[j0 * dp_], dp_, dp_)), dd, &mu_[j0]);
      return;
    }
    key_kind_ = KeyKind::tier_b;
    key_meta_ = page.k.meta + row0 * G_;
    key_outliers_ = page.k.outlier_values + row0 * m2_;
    if (float_tile_) {  // every shared-ξ tile of dither-int8 keys
      if (segments_.size() > 1) GatherKeyMeta();
      for (std::size_t s = 0; s < segments_.size(); ++s) PageDither(s);
      return KeyTileFloat(n);
    }
    DoubleKeyMeta(n);
    for (int i = 0; i < n; ++i)
      for (int g = 0; g < G_; ++g) {
        s_[g * kTile + i] = scales_[i * G_ + g];
        s2_[g * kTile + i] = scales_[i * G_ + g] * scales_[i * G_ + g];
      }
    for (int i = 0; i < n; ++i) DitherKey(page, row0 + i, t0 + i, i);
  }

  // A tile of several pages: its key scales and outlier values copied into one run, [t][g] and [t][j],
  // as a one-page tile finds them in its page.
  void GatherKeyMeta() {
    for (const Segment& seg : segments_) {
      std::copy_n(seg.page.k.meta + seg.row0 * G_, seg.n * G_, &key_meta_buf_[seg.i0 * G_]);
      if (m2_ > 0)
        std::copy_n(seg.page.k.outlier_values + seg.row0 * m2_, seg.n * m2_, &key_outliers_buf_[seg.i0 * m2_]);
    }
    key_meta_ = key_meta_buf_.data();
    key_outliers_ = key_outliers_buf_.data();
  }

  // Q_g of segment s's page into its slot of qgf_: kept from the last tile, or computed.
  void PageDither(std::size_t s) {
    const std::uint32_t counter = segments_[s].page.page_counter;
    if (page_counter_[s] == counter) return;
    const std::size_t slot = static_cast<std::size_t>(group_) * G_;
    for (std::size_t s2 = s + 1; s2 < page_counter_.size(); ++s2)
      if (page_counter_[s2] == counter) {
        std::copy_n(&qgf_[s2 * slot], slot, &qgf_[s * slot]);
        page_counter_[s] = counter;
        return;
      }
    SharedDither(counter, &qgf_[s * slot]);
    page_counter_[s] = counter;
  }

  // The tile's key scales and outlier values as double, [t][g] and [t][j] (contiguous in the page):
  // the double path's, and the float path's when a tile falls back to ScalarTile.
  void DoubleKeyMeta(int n) {
    F16ToDouble(key_meta_, n * G_, scales_.data());
    if (m2_ > 0) F16ToDouble(key_outliers_, n * m2_, outlier_values_.data());
  }

  // Tokens [j0, j0 + kNF) of src ([t][channels], rows up to a whole lane block) with the tokens in
  // lanes: channel ch into dst + ch·stride. Split in registers where the channel count is a power
  // of two up to 16, gathered otherwise.
  static void SplitChannels(const float* src, int channels, int j0, float* dst, std::size_t stride) {
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
  static void PadRows(float* src, int channels, int n) {
    for (int t = n; t < static_cast<int>(hwy::RoundUpTo(static_cast<std::size_t>(n), kNF)); ++t)
      std::copy_n(src + (n - 1) * channels, channels, src + t * channels);
  }

  // Shared-page dither: where the tile's codes lie with the tokens in lanes (code_blocks_[b]: kNF
  // bytes of channel c at codes + c·stride, token b·kNF + lane; CodeDots converts them to float),
  // its scales (sf_[g][t]) and outlier values (outliers_t_[b][j][lane]) likewise; with the meter on,
  // the squared scales (s2f_), the tile's largest s_g² (tile_s2_max_, for Update's choice of
  // weights) and, for EtaBound, the call's running maxima of s_g² (key_s2_max_) and of
  // Σ_j |x_{t,j}| (per lane, x_out_max_). Lanes past the tile repeat its last token, so they move no
  // maximum.
  void KeyTileFloat(int n) {
    const DF df;
    const std::size_t P = static_cast<std::size_t>(cfg_.page_size);
    // Scales and outlier values are token-major in the page: converted in one go, the last token
    // repeated up to a whole lane block, then split into channels with the tokens in lanes.
    float* HWY_RESTRICT meta = meta_f_.data();
    float* HWY_RESTRICT outl = outliers_f_.data();
    F16ToFloat(key_meta_, n * G_, meta);
    if (m2_ > 0) F16ToFloat(key_outliers_, n * m2_, outl);
    PadRows(meta, G_, n);
    PadRows(outl, m2_, n);
    const Segment* seg = segments_.data();
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
      // data(), not [·]: with m = 0 the vector is empty.
      float* xo = outliers_t_.data() + static_cast<std::size_t>(j0 / static_cast<int>(kNF)) * m2_ * kNF;
      VF x_out = hn::Zero(df);
      if (m2_ > 0) SplitChannels(outl, m2_, j0, xo, kNF);
      for (int j = 0; j < m2_; ++j) x_out = hn::Add(x_out, hn::Abs(hn::LoadU(df, xo + j * kNF)));
      if (meter_ && m2_ > 0) hn::StoreU(hn::Max(hn::LoadU(df, x_out_max_.data()), x_out), df, x_out_max_.data());
      // A non-finite stored value makes every query head's logit NaN ("no guarantee"): an infinite
      // scale times a finite code sum would pass for a token of weight 0.
      auto bad = hn::Not(hn::IsFinite(x_out));
      SplitChannels(meta, G_, j0, &sf_[j0], kTile);
      for (int g = 0; g < G_; ++g) {
        const VF sg = hn::LoadU(df, &sf_[g * kTile + j0]);
        bad = hn::Or(bad, hn::Not(hn::IsFinite(sg)));
      }
      hn::StoreU(hn::IfThenElseZero(bad, hn::Set(df, NAN)), df, &poison_[j0]);
      // The keys are channel-major inside a page: kNF consecutive bytes of channel c are the codes
      // of kNF consecutive tokens. A block that would read past the page is copied first (lanes
      // past the tile repeat its last token).
      const std::size_t b = static_cast<std::size_t>(j0) / kNF;
      while (j0 >= seg->i0 + seg->n) ++seg;  // a block lies in one segment (ExtendTile)
      block_segment_[b] = static_cast<int>(seg - segments_.data());
      const std::size_t row = seg->row0 + static_cast<std::size_t>(j0 - seg->i0);
      const std::int8_t* page_codes = seg->page.k.codes;
      CodeBlock& block = code_blocks_[b];
      block.codes = page_codes + row;
      block.stride = P;
      if (row + kNF > P) {  // the tile's last block
        std::int8_t* tail = &tail_codes_[b * d_ * kNF];
        const std::size_t last = static_cast<std::size_t>(n - 1 - j0);
        for (int c = 0; c < d_; ++c)
          for (std::size_t l = 0; l < kNF; ++l) tail[c * kNF + l] = page_codes[c * P + row + std::min(l, last)];
        block.codes = tail;
        block.stride = kNF;
      }
    }
    if (!meter_) return;
    for (int g = 0; g < G_; ++g) {
      VF s2_max = hn::Zero(df);
      for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
        const VF sg = hn::LoadU(df, &sf_[g * kTile + j0]);
        const VF s2 = hn::Mul(sg, sg);  // exact: 22 significant bits
        hn::StoreU(s2, df, &s2f_[g * kTile + j0]);
        s2_max = hn::Max(s2_max, s2);
      }
      tile_s2_max_[g] = hn::GetLane(hn::MaxOfLanes(df, s2_max));
      key_s2_max_[g] = std::max(key_s2_max_[g], tile_s2_max_[g]);
    }
  }

  // k'_t = s_g·(code − ξ_t) with the token's own (per-slot) dither, the fp16 outliers in place; exact
  // in double. Keys that share their page's ξ take the float path instead.
  void DitherKey(const cache::KvStore::Reader::RawPage& page, std::size_t row, std::int64_t pos, int i) {
    const DD dd;
    const hn::Rebind<std::int8_t, DD> di8;
    const hn::Rebind<std::int32_t, DD> di32;
    const std::size_t P = static_cast<std::size_t>(cfg_.page_size);
    for (int c = 0; c < d_; ++c) key_row_[c] = page.k.codes[c * P + row];  // channel-major in the page
    const std::int8_t* codes = key_row_.data();
    DitherRow(stream_, page.counter(pos), d_, xi_.data(), words_.data());
    double* out = &krows_[i * dp_];
    for (int g = 0; g < G_; ++g) {
      const VD s = hn::Set(dd, scales_[i * G_ + g]);
      for (int c = g * kGroup; c < (g + 1) * kGroup; c += static_cast<int>(kN)) {
        VD x = hn::PromoteTo(dd, hn::PromoteTo(di32, hn::LoadU(di8, codes + c)));
        x = hn::Sub(x, hn::PromoteTo(dd, hn::LoadU(DFH(), &xi_[c])));
        hn::StoreU(hn::Mul(x, s), dd, out + c);
      }
    }
    const double* outlier_values = outlier_values_.data() + i * m2_;  // m = 0: empty
    double x_out = 0.0;
    for (int j = 0; j < m2_; ++j) {
      out[outliers_[j]] = outlier_values[j];
      x_out += std::fabs(outlier_values[j]);
    }
    x_out_[i] = x_out;
  }

  // Shared-page dither (float tiles only): ξ of the page and Q_g = Σ_{c∈g, non-outlier} q_c ξ_c per
  // query head ([h][g] into qg), once per page, in float: the group's channels in lanes, kQChains
  // FMA chains summed pairwise, then kNF (head, group) pairs at a time across the lanes
  // (TransposeSum). A term passes through at most kQgRoundings roundings, no more than a code sum's
  // kGroup/kChains + 2 that η_t covers (the comment at the top).
  void SharedDither(std::uint32_t counter, float* qg) {
    const DF df;
    DitherRow(stream_, counter, d_, xi_.data(), words_.data());
    const float* HWY_RESTRICT xi = xi_.data();
    VF sums[kNF];
    int k = 0, p0 = 0;  // sums[k] is (head, group) pair p0 + k, pairs [h][g]
    const auto flush = [&] {
      for (int i = k; i < static_cast<int>(kNF); ++i) sums[i] = hn::Zero(df);
      HWY_ALIGN float out[kNF];
      hn::Store(TransposeSum<DF>(sums), df, out);
      std::copy_n(out, k, qg + p0);
      p0 += k;
      k = 0;
    };
    for (int h = 0; h < group_; ++h) {
      const float* HWY_RESTRICT q = &qbar_f_[h * dp_];
      for (int g = 0; g < G_; ++g) {
        VF acc[kQChains];
        for (VF& a : acc) a = hn::Zero(df);
        for (int j = 0; j < kQChunks; ++j) {
          const std::size_t c = g * kGroup + j * kNF;
          acc[j % kQChains] = hn::MulAdd(hn::LoadU(df, q + c), hn::LoadU(df, xi + c), acc[j % kQChains]);
        }
        for (int width = kQChains; width > 1; width /= 2)
          for (int i = 0; i < width / 2; ++i) acc[i] = hn::Add(acc[2 * i], acc[2 * i + 1]);
        sums[k++] = acc[0];
        if (k == static_cast<int>(kNF)) flush();
      }
    }
    if (k > 0) flush();
  }

  // z̃_t and c_t of one query head for the tile's tokens.
  void Logits(int h, int n) {
    if (float_tile_) return LogitsFloat(h, n);
    const DD dd;
    const double* q = &qd_[h * dp_];
    auto finite = hn::FirstN(dd, kN);
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
      const VD dot = DotRows(q, &krows_[j0 * dp_], dp_, dp_);  // shared-ξ dither keys never come here
      hn::StoreU(hn::Mul(hn::Set(dd, ctx_.sm), dot), dd, &z_[h * kTile + j0]);
      VD c = hn::Zero(dd);
      if (meter_ && key_kind_ == KeyKind::tier_a) {
        // Theorem 2: c_t = sm·Σ_b ‖q_b‖·w_{t,b}.
        VD sum = hn::Zero(dd);
        for (int b = 0; b < B_; ++b)
          sum = hn::MulAdd(hn::Set(dd, qn_[h * B_ + b]), hn::LoadU(dd, &w_band_[b * kTile + j0]), sum);
        c = hn::MulAdd(sum, hn::Set(dd, ctx_.sm * cert::kRoundUpMargin),
                       hn::Mul(hn::Set(dd, eta_q_[h]), hn::LoadU(dd, &mu_[j0])));
      } else if (meter_ && key_kind_ == KeyKind::tier_b) {
        // Lemma 2: u_t = sqrt(ς_t²)·κ; then η_t.
        VD v2 = hn::Zero(dd), eta = hn::Mul(hn::Set(dd, eta_x_[h]), hn::LoadU(dd, &x_out_[j0]));
        for (int g = 0; g < G_; ++g) {
          v2 = hn::MulAdd(hn::Set(dd, q2_[h * G_ + g]), hn::LoadU(dd, &s2_[g * kTile + j0]), v2);
          eta = hn::MulAdd(hn::Set(dd, eta_g_[h * G_ + g]), hn::LoadU(dd, &s_[g * kTile + j0]), eta);
        }
        c = hn::MulAdd(hn::Sqrt(hn::Mul(v2, hn::Set(dd, v2_scale_))), hn::Set(dd, kappa_), eta);
      }
      hn::StoreU(c, dd, &c_[h * kTile + j0]);
      const VD z = hn::LoadU(dd, &z_[h * kTile + j0]);
      const auto ok = hn::And(hn::IsFinite(hn::Add(z, c)), hn::And(hn::IsFinite(z), hn::IsFinite(hn::Sub(z, c))));
      finite = hn::And(finite, hn::Or(ok, hn::Not(hn::FirstN(dd, static_cast<std::size_t>(n - j0)))));
    }
    finite_[h] = hn::AllTrue(dd, finite);
  }

  // Σ_{c∈g} q̄_c·code_{t,c} of every group g, for NH query heads from h0 in one pass over the
  // tile's codes (kChains FMA chains per head and group), into code_dots_.
  template <int NH>
  void CodeDots(int h0, int n) {
    const DF df;
    const hn::Rebind<std::int8_t, DF> di8;
    const hn::Rebind<std::int32_t, DF> di32;
    const float* HWY_RESTRICT q = &qbarf_[h0 * dp_];  // [c][NH]
    float* HWY_RESTRICT out = &code_dots_[h0 * G_ * kTile];
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
      const CodeBlock& block = code_blocks_[static_cast<std::size_t>(j0) / kNF];
      const std::int8_t* codes = block.codes;
      const std::size_t stride = block.stride;
      for (int g = 0; g < G_; ++g) {
        VF a[NH][kChains];
        for (auto& chains : a)
          for (VF& x : chains) x = hn::Zero(df);
        for (int c = g * kGroup; c < (g + 1) * kGroup; c += kChains)
          for (int k = 0; k < kChains; ++k) {
            const VF code = hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(di8, codes + (c + k) * stride)));
            for (int j = 0; j < NH; ++j) a[j][k] = hn::MulAdd(hn::Set(df, q[(c + k) * NH + j]), code, a[j][k]);
          }
        for (int j = 0; j < NH; ++j) hn::StoreU(SumChains(a[j]), df, out + (j * G_ + g) * kTile + j0);
      }
    }
  }

  void AllCodeDots(int n) {
    for (int h0 = 0; h0 < group_; h0 += kCodeHeads)
      WithHeads<kCodeHeads>(std::min(kCodeHeads, group_ - h0), [&]<int NH>() { CodeDots<NH>(h0, n); });
  }

  // f.operator()<nh>() for 1 ≤ nh ≤ kMax: a head count known at compile time (the passes that
  // share one load among several query heads keep NH accumulators each).
  template <int kMax, class F>
  static void WithHeads(int nh, F&& f) {
    if constexpr (kMax > 1)
      if (nh < kMax) return WithHeads<kMax - 1>(nh, f);
    f.template operator()<kMax>();
  }

  // Shared-page dither-int8 keys, in float with the tile's tokens in lanes:
  //   z̃_t = sm·(q·k'_t − Σ_g Q_g s_{g,t}).
  // The radii come with the weights (UpdateFloat) or from Radii.
  void LogitsFloat(int h, int n) {
    const DF df;
    const VF sm = hn::Set(df, static_cast<float>(ctx_.sm));
    VF probe = hn::Zero(df);  // ±inf or NaN in a lane where some z̃_t is not finite
    VF z_max = hn::Set(df, -HUGE_VALF);
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
      const std::size_t b = static_cast<std::size_t>(j0) / kNF;
      const float* qg = &qgf_[(static_cast<std::size_t>(block_segment_[b]) * group_ + h) * G_];
      VF dot = hn::Zero(df);
      for (int j = 0; j < m2_; ++j)
        dot = hn::MulAdd(hn::Set(df, q_out_[h * m2_ + j]), hn::LoadU(df, &outliers_t_[(b * m2_ + j) * kNF]), dot);
      for (int g = 0; g < G_; ++g) {
        const VF sg = hn::LoadU(df, &sf_[g * kTile + j0]);
        const VF code_dot = hn::LoadU(df, &code_dots_[(h * G_ + g) * kTile + j0]);
        dot = hn::MulAdd(sg, hn::Sub(code_dot, hn::Set(df, qg[g])), dot);
      }
      const VF z = hn::Add(hn::Mul(sm, dot), hn::LoadU(df, &poison_[j0]));  // NaN where a stored value is not finite
      const auto valid = hn::FirstN(df, static_cast<std::size_t>(n - j0));
      z_max = hn::Max(z_max, hn::IfThenElse(valid, z, z_max));
      hn::StoreU(z, df, &zf_[h * kTile + j0]);
      probe = hn::Add(probe, hn::IfThenElseZero(valid, hn::Abs(z)));
    }
    finite_[h] = hn::AllTrue(df, hn::IsFinite(probe));
    z_max_[h] = hn::GetLane(hn::MaxOfLanes(df, z_max));
  }

  // ≥ max_t a_t² over head h's float tile, from the tile's largest s_g² (KeyTileFloat), widened past
  // the float roundings of a_t²: Update's choice between float and double weights. It bounds no sum.
  double RadiusSquaredMax(int h) const {
    double v2 = 0.0;
    for (int g = 0; g < G_; ++g) v2 += static_cast<double>(cq2f_[h * G_ + g]) * tile_s2_max_[g];
    return v2 * (1.0 + 0x1p-20);
  }

  // a_t² = Σ_g cq2_g s_{g,t}² (v2_t) of kNF tokens in lanes, s2[g·step + lane] = s_{g,t}²: the factors
  // sm²/12, κ² and (1 + 2^-17)² are folded into cq2f_ (the constructor), so that a_t = sqrt(v2_t) is
  // sqrt(ς_t²)·κ·(1 + 2^-17) up to float rounding (the comment at the top); η_t enters through η'
  // (EtaBound).
  HWY_INLINE VF RadiusSquared(int h, const float* s2, std::size_t step) const {
    const DF df;
    VF v2 = hn::Zero(df);
    for (int g = 0; g < G_; ++g) v2 = hn::MulAdd(hn::Set(df, cq2f_[h * G_ + g]), hn::LoadU(df, s2 + g * step), v2);
    return v2;
  }

  // a_t of head h's tokens into cf_, for DoubleLogits. Lanes past the tile's end repeat its last
  // token (PadRows).
  void Radii(int h, int n) {
    const DF df;
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF))
      hn::StoreU(hn::Sqrt(RadiusSquared(h, &s2f_[j0], kTile)), df, &cf_[h * kTile + j0]);
  }

  // A float tile's z̃_t as double, and c_t ≤ a_t + η' (rounded up), for Update's double weights and
  // ScalarTile; c_t = 0 in the lanes past the tile's end.
  void DoubleLogits(int h, int n) {
    const double eta = meter_ ? EtaBound(h) : 0.0;
    if (meter_) Radii(h, n);
    for (int i = 0; i < n; ++i) {
      z_[h * kTile + i] = zf_[h * kTile + i];
      c_[h * kTile + i] = (cf_[h * kTile + i] + eta) * (1.0 + 0x1p-50);
    }
    std::fill(&c_[h * kTile + n], &c_[h * kTile] + hwy::RoundUpTo(static_cast<std::size_t>(n), kN), 0.0);
  }

  // --- Values: float rows, ρ_t and ‖v̂_t‖ in token lanes.

  void LoadValues(const cache::KvStore::Reader::RawPage& page, std::int64_t t0, int n, bool packed) {
    const DD dd;
    const std::size_t row0 = static_cast<std::size_t>(t0 - page.begin);
    value_codes_ = false;
    rows_ready_ = true;
    norms_pending_ = false;
    stored_v_max_ = -1.0;
    // ρ_t in float (v_rho_f_: exact, an fp16 value, 0 past the tile; DitherValues' own), and in double
    // only where a double path of the meter reads it (RhoDouble). tile_rho_max_: max(0, max_t ρ_t), a
    // NaN ρ_t left out (as DitherValues).
    rho_double_pending_ = meter_;
    tile_rho_max_ = 0.0;
    if (!packed) {
      for (int i = 0; i < n; ++i) F16FloatRow(page.v.exact + (row0 + i) * d_, &vrows_[i * dp_]);
      std::fill(v_rho_f_.begin(), v_rho_f_.end(), 0.0f);
    } else if (v_kind_ == cache::FormatKind::scheme) {
      const quant::KvScheme& scheme = *r_.scheme(quant::KvSide::value);
      for (int i = 0; i < n; ++i) {
        DecodeScheme(scheme, quant::KvSide::value, page.v.packed, row0 + i, t0 + i, &vrows_[i * dp_], v_block_);
        v_rho_f_[i] = fp16_to_float(page.v.meta[row0 + i]);
        tile_rho_max_ = std::max(tile_rho_max_, static_cast<double>(v_rho_f_[i]));
      }
      std::fill(v_rho_f_.begin() + n, v_rho_f_.end(), 0.0f);
    } else {
      DitherValues();
      return;
    }
    if (!meter_) return;
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN))
      hn::StoreU(hn::Sqrt(SquaredNorms(&vrows_[j0 * dp_], dp_, dp_)), dd, &vnorm_[j0]);
  }

  // dither-int8 values: v̂ = s_g·code, exact in float (11 × 8 bits). The rows are not decoded here on
  // AVX-512 (kValueCodes): AccumulateCodeHeads takes Σ_t w_t v̂_t from the codes, and ValueRows
  // decodes the rows only for a head that takes ScalarTile. With the meter on, ρ_t here in token
  // lanes, and max_t(‖v̂_t‖ + ρ_t) from the pages when the tile holds them whole; otherwise ‖v̂_t‖
  // later (ValueNorms): ‖v̂_t‖² = Σ_g s_g²·C_{t,g} with C_{t,g} = Σ_{c∈g} code_c², an integer below
  // 2^24 and so exact in float in any order: per token and group a vector whose lanes sum to
  // C_{t,g} (CodeSquares), reduced kNF tokens at a time.
  void DitherValues() {
    // Locals: the stores below would otherwise make the compiler reload every member per vector.
    const int G = G_;
    float* HWY_RESTRICT scales = v_scalesf_.data();
    float* HWY_RESTRICT s_tf = v_s_tf_.data();
    for (const Segment& seg : segments_)
      F16ToFloat(seg.page.v.meta + seg.row0 * G, seg.n * G, scales + seg.i0 * G);
    value_codes_ = kValueCodes;
    rows_ready_ = false;
    const int n = segments_.back().i0 + segments_.back().n;
    // The scales in token lanes; lanes past the tile's end repeat its last token (finite ρ_t and
    // ‖v̂_t‖ there, whatever a past tile held; their C_{t,g} is 0).
    PadRows(scales, G, n);
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) SplitChannels(scales, G, j0, s_tf + j0, kTile);
    if (!meter_) {  // the V-side terms belong to the meter
      if constexpr (!kValueCodes) DecodeValueRows<false>();
      return;
    }
    // |v̂ − v| ≤ s/2 per channel plus the float rounding of the decode, as in the Reader:
    // ρ_t = sqrt(Σ_g s_g²)·sqrt(32)·(½ + 2^-17), in float with RhoFactor rounded up, which also
    // covers the float roundings (Σ_g s_g², the square root, the product).
    const DF df;
    const VF rho_factor = hn::Set(df, rho_factor_);  // RhoFactor()
    float* HWY_RESTRICT rho_f = v_rho_f_.data();
    VF rho_max = hn::Zero(df);  // a NaN ρ_t left out, as MaxOfSums does
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
      VF s2 = hn::Zero(df);
      for (int g = 0; g < G; ++g) {
        const VF s = hn::LoadU(df, s_tf + g * kTile + j0);
        s2 = hn::MulAdd(s, s, s2);
      }
      const VF rho = hn::Mul(hn::Sqrt(s2), rho_factor);
      hn::StoreU(rho, df, rho_f + j0);
      rho_max = hn::Max(rho_max, hn::IfThenZeroElse(hn::IsNaN(rho), rho));
    }
    tile_rho_max_ = hn::GetLane(hn::MaxOfLanes(df, rho_max));
    norms_pending_ = true;
    // A tile that holds every packed token of its pages takes max_t (‖v̂_t‖ + ρ_t) from the pages
    // (KvStore keeps it at write time, as value_norm_bound computes it, rounded up); others, and
    // ScalarTile, compute ‖v̂_t‖ (ValueNorms).
    double stored = 0.0;
    for (const Segment& seg : segments_) {
      const RawPage& pg = seg.page;
      const bool whole = seg.row0 == 0 && pg.begin + seg.n == pg.v.packed_end && pg.v.norm_max != nullptr &&
                         std::isfinite(*pg.v.norm_max);
      stored = whole ? std::max(stored, static_cast<double>(*pg.v.norm_max)) : -1.0;
      if (!whole) break;
    }
    stored_v_max_ = stored;
    if constexpr (!kValueCodes) DecodeValueRows<true>();  // the float codes' squares come with the rows
  }

  // ρ_t of the value tile in double (rho_), once per tile and only for the paths that read it.
  void RhoDouble() {
    if (!rho_double_pending_) return;
    rho_double_pending_ = false;
    const DD dd;
    const int n = segments_.back().i0 + segments_.back().n;
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN))
      hn::StoreU(hn::PromoteTo(dd, hn::LoadU(DFH(), &v_rho_f_[j0])), dd, &rho_[j0]);
  }

  // sqrt(32)·(½ + 2^-17)·(1 + (G + 4)·2^-24) rounded up to float: kv_store's ρ_t per unit of
  // sqrt(Σ_g s_g²), with room for DitherValues' float roundings (G/2 + 2 relative at most).
  float RhoFactor() const {
    return cert::float_round_up(std::sqrt(static_cast<double>(kGroup)) * (0.5 + 0x1p-17) * (1.0 + (G_ + 4) * 0x1p-24));
  }

  // ‖v̂_t‖ of a dither-int8 value tile into vnorm_, once per tile and only where needed (a tile
  // that does not hold whole pages, or a head's ScalarTile): on AVX-512 after AccumulateAll, while
  // the tile's codes are still in the L1 cache, with each kNF tokens' code squares summed across
  // lanes in registers.
  void ValueNorms() {
    if (!norms_pending_) return;
    norms_pending_ = false;
    const DD dd;
    const DF df;
    const int G = G_;
    const int n = segments_.back().i0 + segments_.back().n;
    float* HWY_RESTRICT code_sum = code_sum_.data();
    const float* HWY_RESTRICT s_tf = v_s_tf_.data();
    for (int g = 0; g < G; ++g)
      for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
        if constexpr (kValueCodes) {  // integer lanes: exact, converted once the lanes are summed
          const DI di;
          VI sums[kNF];
          // A lane block lies in one segment (ExtendTile): its tokens' codes are rows d apart.
          const Segment* seg = segments_.data();
          while (j0 >= seg->i0 + seg->n) ++seg;
          const std::int8_t* codes = seg->page.v.codes + (seg->row0 + static_cast<std::size_t>(j0 - seg->i0)) * d_ + g * kGroup;
          if (j0 + static_cast<int>(kNF) <= n) {
            for (std::size_t j = 0; j < kNF; ++j) sums[j] = CodeSquares(codes + j * d_);
          } else {
            for (std::size_t j = 0; j < kNF; ++j)
              sums[j] = j0 + static_cast<int>(j) < n ? CodeSquares(codes + j * d_) : hn::Zero(di);
          }
          hn::StoreU(hn::ConvertTo(df, TransposeSum<DI>(sums)), df, code_sum + g * kTile + j0);
        } else {
          const float* HWY_RESTRICT code_sq = code_sq_.data();
          VF sums[kNF];
          for (std::size_t j = 0; j < kNF; ++j)
            sums[j] = j0 + static_cast<int>(j) < n ? hn::LoadU(df, code_sq + (g * kTile + j0 + j) * kNF) : hn::Zero(df);
          hn::StoreU(TransposeSum<DF>(sums), df, code_sum + g * kTile + j0);
        }
      }
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
      VD norm2 = hn::Zero(dd);
      for (int g = 0; g < G; ++g) {
        const VD s = hn::PromoteTo(dd, hn::LoadU(DFH(), s_tf + g * kTile + j0));
        norm2 = hn::MulAdd(hn::Mul(s, s), hn::PromoteTo(dd, hn::LoadU(DFH(), code_sum + g * kTile + j0)), norm2);
      }
      hn::StoreU(hn::Sqrt(norm2), dd, &vnorm_[j0]);
    }
  }

  // The tile's dither-int8 value rows v̂_t = s_{t,g}·code_t in vrows_, for ScalarTile (kValueCodes):
  // decoded once, on the first head that needs them.
  void ValueRows() {
    if (!rows_ready_) DecodeValueRows<false>();
  }

  // vrows_ from the codes and v_scalesf_; with kSquares also code_sq_ (as CodeSquares, from the
  // float codes).
  template <bool kSquares>
  void DecodeValueRows() {
    rows_ready_ = true;
    const DF df;
    const hn::Rebind<std::int8_t, DF> d8;
    const hn::Rebind<std::int32_t, DF> d32;
    const int G = G_, d = d_;  // locals: the stores would otherwise make the compiler reload members
    const std::size_t dp = dp_;
    const float* HWY_RESTRICT scales = v_scalesf_.data();
    float* HWY_RESTRICT rows = vrows_.data();
    float* HWY_RESTRICT code_sq = code_sq_.data();
    for (const Segment& seg : segments_) {
      const std::int8_t* codes = seg.page.v.codes + seg.row0 * d;
      for (int i = seg.i0; i < seg.i0 + seg.n; ++i, codes += d)
        for (int g = 0; g < G; ++g) {
          const VF s = hn::Set(df, scales[i * G + g]);
          VF sq = hn::Zero(df);
          for (std::size_t k = 0; k < kGroup / kNF; ++k) {  // a fixed count: unrolled
            const std::size_t c = g * kGroup + k * kNF;
            const VF code = hn::ConvertTo(df, hn::PromoteTo(d32, hn::LoadU(d8, codes + c)));
            hn::StoreU(hn::Mul(code, s), df, rows + i * dp + c);
            if constexpr (kSquares) sq = hn::MulAdd(code, code, sq);
          }
          if constexpr (kSquares) hn::StoreU(sq, df, code_sq + (g * kTile + i) * kNF);
        }
    }
  }

  // --- Softmax, output and meter statistics of one query head over the tile.

  // The vector update needs a partial whose statistics are finite and in step (p.m and p.l are
  // LSE(z̃)'s m and s, up to the pending sums); anything else takes the reference's token-by-token
  // path.
  static bool Clean(const HeadPartial& p) {
    const auto ok = [](double m) { return !std::isnan(m) && m != kInf; };
    return ok(p.m) && p.meter.z.m == p.m && p.meter.z.s == p.l && ok(p.meter.z_plus_c.m) &&
           ok(p.meter.z_minus_c.m) && !std::isnan(p.meter.c_max);
  }

  // max(0, max_{t<n}(a_t + b_t)) (b may be null), a NaN term left out as std::max leaves it.
  static double MaxOfSums(const double* a, const double* b, int n) {
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

  // Max over the tile's valid lanes of x_t (x: the tile's z̃ shifted by sign·c).
  double TileMax(int h, int n, double sign) const {
    const DD dd;
    VD mx = hn::Set(dd, -kInf);
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
      const VD x = hn::MulAdd(hn::Set(dd, sign), hn::LoadU(dd, &c_[h * kTile + j0]), hn::LoadU(dd, &z_[h * kTile + j0]));
      mx = hn::Max(mx, hn::IfThenElse(hn::FirstN(dd, static_cast<std::size_t>(n - j0)), x, mx));
    }
    return hn::GetLane(hn::MaxOfLanes(dd, mx));
  }

  // LSE_t(z̃_t + sign·c_t) of the tile added to L.
  void LseTile(cert::Lse& L, int h, int n, double sign) const {
    const DD dd;
    const double mx = TileMax(h, n, sign);
    if (mx > L.m) {
      L.s *= std::exp(L.m - mx);
      L.m = mx;
    }
    VD sum = hn::Zero(dd);
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
      const VD x = hn::MulAdd(hn::Set(dd, sign), hn::LoadU(dd, &c_[h * kTile + j0]), hn::LoadU(dd, &z_[h * kTile + j0]));
      const VD e = hn::Exp(dd, hn::Sub(x, hn::Set(dd, L.m)));
      sum = hn::Add(sum, hn::IfThenElseZero(hn::FirstN(dd, static_cast<std::size_t>(n - j0)), e));
    }
    L.s += hn::GetLane(hn::SumOfLanes(dd, sum));
  }

  // While LSE(z̃ ± c) keep the reference point m of LSE(z̃) (the usual case: they start there and
  // move with it), their terms are the softmax weights times e^{±c_t}: one exponential and one
  // division per token instead of two exponentials. Below this c_t, Σ_t e^{z̃_t − m + c_t} cannot
  // overflow for any realistic token count.
  static constexpr double kSharedReferenceMaxC = 600.0;
  // A float tile's weights carry the allowance ε̄·(e^f − 1) on A (cert::float_weight_error, ε̄ about
  // 1e-6, f the tile's largest c_t): up to f = 4 below 1e-4 of A − 1's scale. Tiles with larger c_t
  // take double weights (Update), still as moment tokens.
  static constexpr double kFloatWeightMaxC = 4.0;

  // The tile's sums go to per-head vector accumulators (one lane per token slot), reduced into the
  // partial only by Flush: the same additions, fewer horizontal reductions.
  enum Pending { kL, kRho, kPlus, kMinus, kCMax, kMomW, kMom1, kMom2, kPendings };
  double* pending(int h, Pending what) { return &pending_[(h * kPendings + what) * kN]; }

  void Flush(int h, HeadPartial& p) {
    const DD dd;
    const auto take = [&](Pending what, bool max) {
      const VD v = hn::LoadU(dd, pending(h, what));
      hn::StoreU(hn::Zero(dd), dd, pending(h, what));
      return hn::GetLane(max ? hn::MaxOfLanes(dd, v) : hn::SumOfLanes(dd, v));
    };
    const double l_pending = take(kL, false);
    p.l += l_pending;
    p.meter.z.s = p.l;
    // Only Update writes the other pending sums; since the last Flush it has not, where l_mixed_
    // says so, and they are still 0.
    if (l_mixed_.empty() || l_mixed_[h]) {
      p.rho += take(kRho, false);
      p.meter.z_plus_c.s += take(kPlus, false);
      p.meter.z_minus_c.s += take(kMinus, false);
      p.meter.c_max = std::max(p.meter.c_max, take(kCMax, true));
      p.meter.mom_w += take(kMomW, false);
      p.meter.mom_c1 += take(kMom1, false);
      p.meter.mom_c2 += take(kMom2, false);
      if (!l_mixed_.empty()) l_mixed_[h] = 0;
    }
    if (chain_steps_.empty() || chain_steps_[h] == 0) return;
    // The float tiles' moment chains (UpdateFloat), k steps per lane since the last Flush: their
    // lanes added in double (kNF additions of one sign, far inside the widening), widened by
    // F = 1 + (k + 2)·2^-23 and kNF·k·2^-146. With η' ≥ η_t for all their tokens (EtaBound, from
    // the call's running maxima) and L = Σ w'_t over them:
    //   Σ w'_t c_t ≤ X1 + η'·L,   Σ w'_t c_t² ≤ X2 + 2η'·X1 + η'²·L,   c_t ≤ max a_t + η',
    // each widened by 2^-40 for its double roundings.
    float* chain = &chains_[static_cast<std::size_t>(h) * kChainCount * kNF];
    const auto lanes = [&](std::size_t i) {  // the lanes of chain i in double
      VD sum = hn::Zero(dd);
      for (std::size_t j = 0; j < kNF; j += kN) sum = hn::Add(sum, hn::PromoteTo(dd, hn::LoadU(DFH(), chain + i * kNF + j)));
      return hn::GetLane(hn::SumOfLanes(dd, sum));
    };
    double x1 = lanes(0), x2 = lanes(1), x3 = lanes(2);
    std::fill_n(chain, kChainCount * kNF, 0.0f);
    const double k = chain_steps_[h], widen = 1.0 + (k + 2.0) * 0x1p-23, tiny = static_cast<double>(kNF) * k * 0x1p-146;
    x1 = x1 * widen + tiny;
    x2 = x2 * widen + tiny;
    // Where every ρ^v_t so far was 0 the chain is exactly 0 and takes no underflow allowance; a NaN
    // ρ^v_t (a NaN value scale) stays NaN.
    p.rho += (x3 * widen + (p.float_rho_max > 0.0 ? tiny : 0.0)) * (1.0 + 0x1p-40);
    const double l = l_pending, eta = EtaBound(h);  // the chains' Σ w'_t (l_mixed_)
    p.meter.mom_w += l;
    p.meter.mom_c1 += (x1 + eta * l) * (1.0 + 0x1p-40);
    p.meter.mom_c2 += (x2 + 2.0 * eta * x1 + eta * eta * l) * (1.0 + 0x1p-40);
    float* a_lanes = &chain_a_max_[static_cast<std::size_t>(h) * kNF];
    const double a_max = hn::GetLane(hn::MaxOfLanes(DF(), hn::LoadU(DF(), a_lanes)));
    std::fill_n(a_lanes, kNF, 0.0f);
    const double c_max = (a_max + eta) * (1.0 + 0x1p-50);
    p.meter.c_max = std::max(p.meter.c_max, c_max);
    p.meter.float_c_max = std::max(p.meter.float_c_max, c_max);
    chain_steps_[h] = 0;
  }

  // A tile whose max logit mz exceeds the head's running max: every sum kept relative to it (the
  // partial's, the pending lanes', and LSE(z̃ ± c) while they share its reference point) is rescaled
  // by e^{m − mz}, and rescale_[h] tells AccumulateAll to do the same to the output.
  void MoveMax(int h, double mz, bool shared_reference, HeadPartial& p) {
    const DD dd;
    rescale_[h] = 1.0;
    if (!(mz > p.m)) return;
    const double r = rescale_[h] = std::exp(p.m - mz);
    p.l *= r;
    p.rho *= r;
    for (Pending what : {kL, kRho, kPlus, kMinus, kMomW, kMom1, kMom2})
      hn::StoreU(hn::Mul(hn::LoadU(dd, pending(h, what)), hn::Set(dd, r)), dd, pending(h, what));
    p.meter.mom_w *= r;  // the moment sums are kept at LSE(z̃)'s reference point
    p.meter.mom_c1 *= r;
    p.meter.mom_c2 *= r;
    if (!chain_steps_.empty() && chain_steps_[h] > 0) {  // r rounded up, and one more rounding step
      const DF df;
      const VF r_up = hn::Set(df, cert::float_round_up(r));
      float* chain = &chains_[static_cast<std::size_t>(h) * kChainCount * kNF];
      for (std::size_t i = 0; i < kChainCount * kNF; i += kNF) hn::StoreU(hn::Mul(hn::LoadU(df, chain + i), r_up), df, chain + i);
      ++chain_steps_[h];
    }
    if (shared_reference) {
      p.meter.z_plus_c.s *= r;
      p.meter.z_minus_c.s *= r;
      p.meter.z_plus_c.m = p.meter.z_minus_c.m = mz;
    }
    p.m = mz;
    p.meter.z.s = p.l;
  }

  void Update(int h, int n, HeadPartial& p) {
    const DD dd;
    cert::Lse& plus = p.meter.z_plus_c;
    cert::Lse& minus = p.meter.z_minus_c;
    const bool moments = float_tile_ && meter_;  // the float tiles' tokens are moment tokens
    if (float_tile_) {
      if (!meter_) return UpdateFloat<false>(h, n, p);
      if (RadiusSquaredMax(h) <= kFloatWeightMaxC * kFloatWeightMaxC) return UpdateFloat<true>(h, n, p);  // η' is far smaller
      DoubleLogits(h, n);
    }
    RhoDouble();
    if (!chain_steps_.empty() && chain_steps_[h] > 0) Flush(h, p);  // a chain's Σ w'_t is the pending kL
    VD c_max = hn::Zero(dd);
    if (meter_)
      for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN))
        c_max = hn::Max(c_max, hn::IfThenElseZero(hn::FirstN(dd, static_cast<std::size_t>(n - j0)),
                                                  hn::LoadU(dd, &c_[h * kTile + j0])));
    hn::StoreU(hn::Max(c_max, hn::LoadU(dd, pending(h, kCMax))), dd, pending(h, kCMax));
    const bool same_reference = plus.m == p.m && minus.m == p.m;
    const bool shared_reference =
        meter_ && same_reference && (moments || hn::AllTrue(dd, hn::Lt(c_max, hn::Set(dd, kSharedReferenceMaxC))));
    if (meter_ && !shared_reference) Flush(h, p);  // LseTile works on the partial itself
    const double mz = TileMax(h, n, 0.0);
    MoveMax(h, mz, shared_reference, p);
    // After the Flushes above (which clear it): the pending sums now take this tile's weights.
    if (!l_mixed_.empty()) l_mixed_[h] = 1;
    const VD m = hn::Set(dd, p.m);
    VD l = hn::LoadU(dd, pending(h, kL)), rho = hn::LoadU(dd, pending(h, kRho));
    VD s_plus = hn::LoadU(dd, pending(h, kPlus)), s_minus = hn::LoadU(dd, pending(h, kMinus));
    VD mom_w = hn::LoadU(dd, pending(h, kMomW)), mom_1 = hn::LoadU(dd, pending(h, kMom1)),
       mom_2 = hn::LoadU(dd, pending(h, kMom2));
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
      const auto valid = hn::FirstN(dd, static_cast<std::size_t>(n - j0));
      const VD w = hn::IfThenElseZero(valid, hn::Exp(dd, hn::Sub(hn::LoadU(dd, &z_[h * kTile + j0]), m)));
      hn::StoreU(hn::DemoteTo(DFH(), w), DFH(), &w_[h * kTile + j0]);
      l = hn::Add(l, w);
      if (!meter_) continue;  // the V-side terms belong to the meter
      rho = hn::MulAdd(w, hn::LoadU(dd, &rho_[j0]), rho);
      if (moments) {
        const VD c = hn::LoadU(dd, &c_[h * kTile + j0]), wc = hn::Mul(w, c);
        mom_w = hn::Add(mom_w, w);
        mom_1 = hn::Add(mom_1, wc);
        mom_2 = hn::MulAdd(wc, c, mom_2);
      } else if (shared_reference) {
        const VD e_c = hn::Exp(dd, hn::LoadU(dd, &c_[h * kTile + j0]));
        s_plus = hn::MulAdd(w, e_c, s_plus);
        s_minus = hn::Add(s_minus, hn::Div(w, e_c));
      }
    }
    hn::StoreU(l, dd, pending(h, kL));
    hn::StoreU(rho, dd, pending(h, kRho));
    hn::StoreU(s_plus, dd, pending(h, kPlus));
    hn::StoreU(s_minus, dd, pending(h, kMinus));
    hn::StoreU(mom_w, dd, pending(h, kMomW));
    hn::StoreU(mom_1, dd, pending(h, kMom1));
    hn::StoreU(mom_2, dd, pending(h, kMom2));
    p.meter.z.m = p.m;  // the same exponentials: LSE(z̃) is (m, l)
    p.meter.n += n;
    if (meter_ && !shared_reference && !moments) {
      LseTile(plus, h, n, 1.0);
      LseTile(minus, h, n, -1.0);
    }
  }

  // A float tile: the weights w_t = e^{z̃_t − m} in float from x_t = z̃_t − m rounded to float
  // (|Δx_t| ≤ 2^-24(1 + 2^-28)|x_t|) and Highway's Exp (≤ 1 ulp; 2^-20 is taken), so
  // w'_t = w_t(1 + ε_t) with |ε_t| ≤ 2^-20 + 2^-24(1 + 2^-20)|x_t|, or |w'_t − w_t| ≤ 2^-125 where
  // e^{x_t} underflows; the same w'_t enter LSE(z̃) and the moment sums, and
  // MeterStats::float_c_max accounts for it.
  //
  // With the meter on, the tokens are moment tokens (cert::MeterStats::add_moment): per float lane
  // three FMA chains X1 = Σ w'_t a_t, X2 = Σ w'_t a_t² and X3 = Σ w'_t ρ^v_t (ρ^v_t ≥ 0: the value
  // side's Σ w ρ) that run on across tiles (chains_) until
  // Flush folds them into the partial, at most kChainSteps steps later. Every term is nonnegative,
  // so a chain of k rounding steps (its FMAs, and a rescale by MoveMax, with the factor rounded up)
  // is within (1 − 2^-24)^-k of its exact sum, plus at most 2^-150 a step whose rounding underflows.
  // (a_t² is taken as v2_t, the float whose rounded square root is a_t: within 2^-23 of a_t², and
  // v2_t carries the same 1 + 2^-17 as a_t.) Flush widens them by 1 + (k + 2)·2^-23 and
  // kNF·k·2^-146, and adds η' for η_t. Σ w'_t over their tokens is the pending kL, in double: Update
  // folds the chains before it adds other weights there, and UpdateFloat folds those before a
  // chain starts (l_mixed_).
  static constexpr int kChainSteps = 64;
  static constexpr std::size_t kChainCount = 3;  // X1, X2 and Σ w'_t ρ^v_t

  template <bool kMeter>
  void UpdateFloat(int h, int n, HeadPartial& p) {
    const DD dd;
    if constexpr (kMeter) {
      p.float_rho_max = std::max(p.float_rho_max, tile_rho_max_);
      if (l_mixed_[h]) Flush(h, p);  // the chain's Σ w'_t will be the pending kL
    }
    const cert::MeterStats& meter = p.meter;  // LSE(z̃ ± c) move with m while they share it
    MoveMax(h, z_max_[h], meter.z_plus_c.m == p.m && meter.z_minus_c.m == p.m, p);
    const VD m = hn::Set(dd, p.m);
    float* x = xf_.data();
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN))
      hn::StoreU(hn::DemoteTo(DFH(), hn::Sub(hn::PromoteTo(dd, hn::LoadU(DFH(), &zf_[h * kTile + j0])), m)), DFH(), x + j0);
    FloatWeights<kMeter>(h, n);
    const float* w = &w_[h * kTile];
    VD l = hn::LoadU(dd, pending(h, kL));
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) l = hn::Add(l, hn::PromoteTo(dd, hn::LoadU(DFH(), w + j0)));
    hn::StoreU(l, dd, pending(h, kL));
    p.meter.z.m = p.m;
    p.meter.n += n;
    if constexpr (kMeter) {
      chain_steps_[h] += (n + static_cast<int>(kNF) - 1) / static_cast<int>(kNF);
      if (chain_steps_[h] >= kChainSteps) Flush(h, p);
    }
  }

  // UpdateFloat's loop: the weights w'_t = e^{x_t} into w_ and, with the meter on, a_t, a_t² and
  // ρ^v_t into the head's chains.
  template <bool kMeter>
  HWY_INLINE void FloatWeights(int h, int n) {
    const DF df;
    const float* HWY_RESTRICT x = xf_.data();
    const float* HWY_RESTRICT s2 = s2f_.data();
    const float* HWY_RESTRICT rho = v_rho_f_.data();
    float* HWY_RESTRICT w = &w_[h * kTile];
    float* chain = kMeter ? &chains_[static_cast<std::size_t>(h) * kChainCount * kNF] : nullptr;
    VF sum1 = hn::Zero(df), sum2 = hn::Zero(df), sum3 = hn::Zero(df);
    if constexpr (kMeter) {
      sum1 = hn::LoadU(df, chain);
      sum2 = hn::LoadU(df, chain + kNF);
      sum3 = hn::LoadU(df, chain + 2 * kNF);
    }
    // Lanes past the tile's end repeat its last token: they move no maximum.
    float* a_lanes = kMeter ? &chain_a_max_[static_cast<std::size_t>(h) * kNF] : nullptr;
    VF a_max = kMeter ? hn::LoadU(df, a_lanes) : hn::Zero(df);
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
      const auto valid = hn::FirstN(df, static_cast<std::size_t>(n - j0));
      const VF wt = hn::IfThenElseZero(valid, hn::Exp(df, hn::LoadU(df, x + j0)));
      hn::StoreU(wt, df, w + j0);
      if constexpr (kMeter) {
        const VF v2 = RadiusSquared(h, s2 + j0, kTile), a = hn::Sqrt(v2);
        a_max = hn::Max(a_max, a);
        sum1 = hn::MulAdd(wt, a, sum1);
        sum2 = hn::MulAdd(wt, v2, sum2);
        sum3 = hn::MulAdd(wt, hn::LoadU(df, rho + j0), sum3);
      }
    }
    if constexpr (kMeter) {
      hn::StoreU(sum1, df, chain);
      hn::StoreU(sum2, df, chain + kNF);
      hn::StoreU(sum3, df, chain + 2 * kNF);
      hn::StoreU(a_max, df, a_lanes);
    }
  }

  // η' ≥ η_t for every float-tile token of the call so far: its coefficients are positive, so the
  // largest scale per group and largest Σ|x_out| (KeyTileFloat's running maxima) bound it; in
  // double, G + 2 roundings of products of floats, widened by 2^-48. The largest s_g is the square
  // root of the largest s_g², exact: s_g² is the exact square of a float.
  double EtaBound(int h) const {
    const DF df;
    const double x_out = hn::GetLane(hn::MaxOfLanes(df, hn::LoadU(df, x_out_max_.data())));
    double eta = static_cast<double>(ceta0f_) + static_cast<double>(ceta_xf_[h]) * x_out;
    for (int g = 0; g < G_; ++g)
      eta += static_cast<double>(ceta_gf_[h * G_ + g]) * std::sqrt(static_cast<double>(key_s2_max_[g]));
    return eta * (1.0 + 0x1p-48);
  }

  // Σ_t w_t v̂_t over the tile in float, added to each vector-path head's double accumulator; up to
  // kHeadBlock heads share one pass over the value rows.
  void AccumulateAll(int n) {
    const DD dd;
    int heads[std::max(kHeadBlock, kValueHeads)];
    int nh = 0;
    const auto accumulate = [&] {
      if (nh > 0 && value_codes_)
        WithHeads<kValueHeads>(nh, [&]<int NH>() { AccumulateCodeHeads<NH>(heads, n); });
      else if (nh > 0)
        WithHeads<kHeadBlock>(nh, [&]<int NH>() { AccumulateHeads<NH>(heads, n); });
      nh = 0;
    };
    const int block = value_codes_ ? kValueHeads : kHeadBlock;
    for (int h = 0; h < group_; ++h) {
      if (scalar_[h]) continue;
      double* acc = &acc_[h * dp_];
      if (rescale_[h] != 1.0)
        for (std::size_t c = 0; c < dp_; c += kN) hn::StoreU(hn::Mul(hn::LoadU(dd, acc + c), hn::Set(dd, rescale_[h])), dd, acc + c);
      heads[nh++] = h;
      if (nh == block) accumulate();
    }
    accumulate();  // the last block, also when the group's last head took ScalarTile
  }

  template <int NH>
  void AccumulateHeads(const int* heads, int n) {
    std::size_t c = 0;
    for (; c + 4 * kNF <= dp_; c += 4 * kNF) AccumulateColumns<4, NH>(heads, n, c);
    for (; c < dp_; c += kNF) AccumulateColumns<1, NH>(heads, n, c);
  }

  // Columns [c, c + K·kNF) of NH heads: NH·K independent FMA chains over the tile's tokens.
  template <std::size_t K, int NH>
  HWY_INLINE void AccumulateColumns(const int* heads, int n, std::size_t c) {
    const DF df;
    VF sum[NH][K];
    for (auto& s : sum)
      for (VF& x : s) x = hn::Zero(df);
    for (int i = 0; i < n; ++i) {
      const float* row = &vrows_[i * dp_ + c];
      VF r[K];
      for (std::size_t k = 0; k < K; ++k) r[k] = hn::LoadU(df, row + k * kNF);
      for (int j = 0; j < NH; ++j) {
        const VF w = hn::Set(df, w_[heads[j] * kTile + i]);
        for (std::size_t k = 0; k < K; ++k) sum[j][k] = hn::MulAdd(w, r[k], sum[j][k]);
      }
    }
    AddToAccumulators<K, NH>(heads, c, sum);
  }

  // The tile's float sums of columns [c, c + K·kNF) added to the NH heads' double accumulators.
  template <std::size_t K, int NH>
  HWY_INLINE void AddToAccumulators(const int* heads, std::size_t c, const VF (&sum)[NH][K]) {
    const DD dd;
    const DF df;
    for (int j = 0; j < NH; ++j) {
      double* acc = &acc_[heads[j] * dp_];
      HWY_ALIGN float o[K * kNF];
      for (std::size_t k = 0; k < K; ++k) hn::Store(sum[j][k], df, o + k * kNF);
      for (std::size_t x = 0; x < K * kNF; x += kN)
        hn::StoreU(hn::Add(hn::LoadU(dd, acc + c + x), hn::PromoteTo(dd, hn::LoadU(DFH(), o + x))), dd, acc + c + x);
    }
  }

  // dither-int8 values straight from their codes: Σ_t w_t v̂_{t,c} = Σ_t (w_t·s_{t,g})·code_{t,c}, the
  // codes converted once for all NH heads and the products w_t·s_{t,g} formed in token lanes (one
  // more float rounding per term than the float rows' path).
  template <int NH>
  void AccumulateCodeHeads(const int* heads, int n) {
    constexpr std::size_t K = ValueColumns(NH);
    std::size_t c = 0;
    for (; c + K * kNF <= static_cast<std::size_t>(d_); c += K * kNF) AccumulateCodeColumns<K, NH>(heads, n, c);
    for (; c < static_cast<std::size_t>(d_); c += kNF) AccumulateCodeColumns<1, NH>(heads, n, c);
  }

  // Columns [c, c + K·kNF) of NH heads, which span KG groups from c's; ws_[(j·KG + g)·kTile + t] =
  // w_t·s_{t,g} of head j and the pass's group g (a pass of K > 1 blocks starts on a group).
  template <std::size_t K, int NH>
  HWY_INLINE void AccumulateCodeColumns(const int* heads, int n, std::size_t c) {
    constexpr std::size_t KG = (K * kNF + kGroup - 1) / kGroup;
    static_assert(!kValueCodes || K == 1 || K * kNF % kGroup == 0);  // never called without kValueCodes
    const DF df;
    const hn::Rebind<std::int8_t, DF> d8;
    const hn::Rebind<std::int32_t, DF> d32;
    float* HWY_RESTRICT ws = ws_.data();
    for (int j = 0; j < NH; ++j)
      for (std::size_t g = 0; g < KG; ++g) {
        const float* w = &w_[heads[j] * kTile];
        const float* s = &v_s_tf_[(c / kGroup + g) * kTile];
        for (int i0 = 0; i0 < n; i0 += static_cast<int>(kNF))
          hn::StoreU(hn::Mul(hn::LoadU(df, w + i0), hn::LoadU(df, s + i0)), df, ws + (j * KG + g) * kTile + i0);
      }
    VF sum[NH][K];
    for (auto& s : sum)
      for (VF& x : s) x = hn::Zero(df);
    for (const Segment& seg : segments_) {
      const std::int8_t* codes = seg.page.v.codes + seg.row0 * d_ + c;
      for (int i = seg.i0; i < seg.i0 + seg.n; ++i, codes += d_) {
        VF x[K];
        for (std::size_t k = 0; k < K; ++k) x[k] = hn::ConvertTo(df, hn::PromoteTo(d32, hn::LoadU(d8, codes + k * kNF)));
        for (int j = 0; j < NH; ++j)
          for (std::size_t k = 0; k < K; ++k)
            sum[j][k] = hn::MulAdd(hn::Set(df, ws[(j * KG + k * kNF / kGroup) * kTile + i]), x[k], sum[j][k]);
      }
    }
    AddToAccumulators<K, NH>(heads, c, sum);
  }

  // The reference's token-by-token update (certified_attention.cc), for tiles with a non-finite
  // logit or bound and for partials already poisoned by one. c_t comes from the cert functions,
  // which skip bands and groups the query does not touch.
  void ScalarTile(int h, int n, HeadPartial& p) {
    ValueRows();
    RhoDouble();
    if (float_tile_) {
      DoubleKeyMeta(n);
      DoubleLogits(h, n);
    }
    const float* qh = q_ + h * d_;
    double* acc = &acc_[h * dp_];
    for (int i = 0; i < n; ++i) {
      const double z = z_[h * kTile + i];
      double c = 0.0;
      if (meter_ && key_kind_ == KeyKind::tier_a) {
        c = cert::tier_a_c(std::span<const double>(&qn_[h * B_], B_), std::span<const f16>(key_meta_ + i * B_, B_),
                           ctx_.sm) +
            eta_q_[h] * mu_[i];
      } else if (meter_ && key_kind_ == KeyKind::tier_b) {
        const double v2 = cert::dither_variance_proxy(std::span<const float>(qh, d_),
                                                      std::span<const f16>(key_meta_ + i * G_, G_),
                                                      std::span<const std::uint8_t>(r_.outlier_mask(), d_), kGroup,
                                                      ctx_.sm);
        // The float path's logits carry its own, larger allowance.
        double x_out = 0.0;  // Σ_{outlier c}|x_{t,c}|, as x_out_ holds it for the double path
        for (int j = 0; j < m2_; ++j) x_out += std::fabs(outlier_values_[i * m2_ + j]);
        double eta = float_tile_ ? eta0_ + eta_xf_[h] * x_out : eta_x_[h] * x_out;
        for (int g = 0; g < G_; ++g)
          eta += (float_tile_ ? eta_gf_[h * G_ + g] : eta_g_[h * G_ + g]) * scales_[i * G_ + g];
        c = cert::subgaussian_radius(v2, ctx_.S, ctx_.delta_loc, r_.non_outlier_channels()) + eta;
      }
      if (float_tile_)  // moment tokens, as the reference takes shared-ξ keys
        p.meter.add_moment(z, c);
      else
        p.meter.add(z, c);
      if (!std::isfinite(z)) {  // NaN or Inf in q or k̂: the meter already reads "no guarantee"
        p.m = std::isnan(z) ? NAN : std::max(p.m, z);
        continue;
      }
      if (z > p.m) {
        const double scale = std::exp(p.m - z);
        for (int c2 = 0; c2 < d_; ++c2) acc[c2] *= scale;
        p.l *= scale;
        p.rho *= scale;
        p.m = z;
      }
      const double w = std::exp(z - p.m);
      for (int c2 = 0; c2 < d_; ++c2) acc[c2] += w * vrows_[i * dp_ + c2];
      p.l += w;
      if (!meter_) continue;
      p.rho += w * rho_[i];
      p.v_max = std::max(p.v_max, vnorm_[i] + rho_[i]);
    }
  }

  // --- Decoding helpers.

  static void F16ToDouble(const f16* src, int n, double* out) {
    const DD dd;
    int c = 0;
    for (; c + static_cast<int>(kN) <= n; c += static_cast<int>(kN))
      hn::StoreU(hn::PromoteTo(dd, LoadF16(DFH(), src + c)), dd, out + c);
    for (; c < n; ++c) out[c] = fp16_to_float(src[c]);
  }

  static void F16ToFloat(const f16* src, int n, float* out) {
    const DF df;
    int c = 0;
    for (; c + static_cast<int>(kNF) <= n; c += static_cast<int>(kNF)) hn::StoreU(LoadF16(df, src + c), df, out + c);
    for (; c < n; ++c) out[c] = fp16_to_float(src[c]);
  }

  void F16FloatRow(const f16* src, float* out) const { F16ToFloat(src, d_, out); }

  void FloatRow(const float* src, double* out) const {
    const DD dd;
    for (std::size_t c = 0; c < dp_; c += kN) hn::StoreU(hn::PromoteTo(dd, hn::LoadU(DFH(), src + c)), dd, out + c);
  }

  struct BlockCache {
    std::int64_t block = -1;
    std::vector<float> decoded;
  };

  // One token of a scheme side into out (d floats): a per-token scheme decodes its own bytes, a
  // group scheme its whole block once.
  void DecodeScheme(const quant::KvScheme& scheme, quant::KvSide side, const std::uint8_t* packed, std::size_t row,
                    std::int64_t pos, float* out, BlockCache& cache) const {
    const int T = scheme.tokens_per_block();
    if (T == 1) {
      scheme.decode(packed + row * scheme.block_bytes(d_), d_, out);
      return;
    }
    if (cache.block != pos / T) {
      cache.decoded.resize(static_cast<std::size_t>(T) * d_);
      scheme.decode(r_.group_block(side, pos / T), d_, cache.decoded.data());
      cache.block = pos / T;
    }
    std::copy_n(&cache.decoded[(pos % T) * d_], d_, out);
  }

  cache::KvStore::Reader& r_;
  const cache::CacheConfig& cfg_;
  const float* q_;
  const int group_, d_;
  const std::size_t dp_;  // row stride: d rounded up to whole float vectors, padded with zeros
  const BoundContext ctx_;
  const bool meter_;
  const cache::FormatKind k_kind_, v_kind_;
  const int G_, B_, m2_;  // scale groups, bands, outlier channels
  const bool float_keys_;  // dither-int8 keys that may share ξ: tiles of shared-ξ keys take the float path
  bool shared_tile_ = false;  // the tile's keys share their page's ξ
  bool float_tile_ = false;   // the tile takes the float path

  // Float keys only.
  std::vector<float> qbarf_;       // q, the outlier channels zeroed: per head block of CodeDots [c][heads]
  std::vector<float> q_out_;       // [h][2m] q at the outlier channels
  struct CodeBlock {
    const std::int8_t* codes = nullptr;  // channel c's kNF codes at codes + c·stride
    std::size_t stride = 0;
  };
  std::vector<CodeBlock> code_blocks_;  // [b] the tile's key codes, tokens in lanes
  std::vector<float> outliers_t_;  // [b][j][lane] the tile's outlier values, tokens in lanes
  std::vector<float> code_dots_;   // [h][g][t] Σ_{c∈g} q̄_c·code_{t,c}
  std::vector<std::int8_t> tail_codes_;  // [c][lane] a lane block that would read past its page
  std::vector<float> meta_f_;      // [t][g] the tile's key scales, as stored
  std::vector<float> outliers_f_;  // [t][j] the tile's outlier values, as stored
  double eta0_ = 0.0;        // η_t's allowance for underflow in the float products
  std::vector<float> sf_, s2f_;  // [g][t] the tile's key scales and their squares
  std::vector<float> poison_;  // [t] NaN where the token's scale or outlier values are not finite, else 0
  std::vector<float> tile_s2_max_;  // [g] the tile's largest s_g² (KeyTileFloat)
  std::vector<float> key_s2_max_;   // [g] the float tiles' largest s_g² in the call so far
  std::vector<float> x_out_max_;    // [lane] and their largest Σ|x_out|
  std::vector<float> chains_;       // [h][kChainCount][kNF] UpdateFloat's running X1, X2 and X3 chains
  std::vector<int> chain_steps_;    // [h] their rounding steps since the last Flush
  std::vector<float> chain_a_max_;  // [h][lane] max a_t over their tokens
  // [h] the pending kL holds weights of a tile that was not a float tile's (Update): UpdateFloat
  // flushes it before a chain starts, so that a chain's Σ w'_t is the pending kL.
  std::vector<std::uint8_t> l_mixed_;
  std::vector<float> qgf_;         // [segment][h][G] Q_g of the segment's page
  std::vector<float> eta_gf_;  // [h][G] η's coefficient of s_g (ScalarTile)
  std::vector<float> eta_xf_;  // [h]
  std::vector<float> cq2f_;    // [h][G] LogitsFloat's (sm²/12)·κ²·Σ q_c², times (1 + 2^-17)²
  std::vector<float> ceta_gf_, ceta_xf_;  // EtaBound's: η's coefficients times 1 + 2^-17
  float ceta0f_ = 0.0f;
  std::vector<float> zf_, cf_;  // [h][t] z̃_t (LogitsFloat) and a_t (Radii)
  std::vector<double> z_max_;  // [h] the tile's max z̃_t (LogitsFloat)
  std::vector<float> xf_;          // [t] z̃_t − m

  // Per call: the queries and their constants.
  std::vector<double> qd_;    // [h][dp] q as double
  std::vector<double> eta_q_;  // [h] η_t/‖k̂_t‖ (Tier A)
  std::vector<double> eta_g_;  // [h][G] sm·(d + 64)·2^-52·128·‖q_g‖₁: η_t = Σ_g eta_g·s_{g,t} + eta_x·Σ|x_out| (Tier B)
  std::vector<double> eta_x_;  // [h] sm·(d + 64)·2^-52·max_{outlier c}|q_c|
  std::vector<double> qn_;    // [h][B] ‖q_b‖ (Tier A)
  std::vector<double> q2_;    // [h][G] Σ_{c∈g, non-outlier} q_c² (Tier B)
  std::vector<double> qbar_;  // [h][dp] q with the outlier channels zeroed
  std::vector<float> qbar_f_;   // [h][dp] the same in float (float tiles)
  std::vector<int> outliers_;
  double v2_scale_ = 0.0, kappa_ = 0.0;
  quant::DitherStream stream_;

  // Per tile.
  KeyKind key_kind_ = KeyKind::exact;
  const f16* key_meta_ = nullptr;   // the tile's witness rows or dither scale rows
  const f16* key_outliers_ = nullptr;  // the tile's dither-int8 outlier values
  std::vector<double> krows_;       // [t][dp] k'_t
  std::vector<std::int8_t> key_row_;  // [c] one dither-int8 key's codes, gathered from its page
  std::vector<float> kfloat_;       // one decoded scheme key
  std::vector<float> xi_;           // ξ of the token (per-slot) or of the page (shared)
  std::vector<std::uint32_t> words_;
  struct Segment {  // the part of a tile that lies in one page
    RawPage page;
    std::size_t row0;  // the segment's first row in the page
    int i0, n;         // its first token in the tile, its tokens
  };
  std::vector<Segment> segments_;  // the tile's pages, in order
  std::vector<int> block_segment_;  // [b] the segment of lane block b (float tiles)
  std::vector<std::int64_t> page_counter_;  // [segment] the shared-ξ counter word qgf_'s slot belongs to
  std::vector<f16> key_meta_buf_, key_outliers_buf_;  // a tile of several pages: its scales and outlier values
  std::vector<double> w_band_;      // [b][t] witness
  std::vector<double> s_, s2_;      // [g][t] dither scale and its square
  std::vector<double> scales_;      // [t][g] the tile's key scales
  std::vector<double> outlier_values_;  // [t][2m] the tile's outlier values
  std::vector<double> mu_;          // [t] ‖k̂_t‖ (Tier A)
  std::vector<double> x_out_;       // [t] Σ_{outlier c} |x_{t,c}| (Tier B)
  std::vector<double> band_row_;    // one token's witness
  std::vector<float> vrows_;        // [t][dp] v̂_t
  std::vector<float> v_scalesf_;    // [t][g] the tile's value scales (dither-int8)
  std::vector<float> v_s_tf_;       // [g][t] the same, token lanes
  std::vector<float> v_rho_f_;      // [t] ρ_t in float (DitherValues)
  float rho_factor_ = 0.0f;
  std::vector<float> ws_;           // [head][group of the pass][t] w_t·s_{t,g} (AccumulateCodeColumns)
  bool value_codes_ = false;        // the tile's values are dither-int8 codes: AccumulateCodeHeads
  bool rows_ready_ = true;          // vrows_ holds the tile's v̂_t
  std::vector<float> code_sq_;      // [g][t][kNF] lane sums of the value codes' squares (float rows)
  bool norms_pending_ = false;  // vnorm_ of a dither-int8 value tile not computed yet (ValueNorms)
  double stored_v_max_ = -1.0;  // max_t (‖v̂_t‖ + ρ_t) of the tile from its pages; < 0: none
  std::vector<float> code_sum_;     // [g][t] C_{t,g} = Σ_{c∈g} code_c²
  std::vector<double> rho_, vnorm_; // [t] ρ^v_t, ‖v̂_t‖
  double tile_rho_max_ = 0.0;  // max_t ρ^v_t over the tile
  bool rho_double_pending_ = false;  // rho_ not filled from v_rho_f_ yet (RhoDouble)
  std::vector<double> z_, c_;       // [h][t]
  std::vector<float> w_;            // [h][t] e^{z̃_t − m}
  std::vector<double> acc_;         // [h][dp] Σ e^{z̃_t − m} v̂_t
  std::vector<double> rescale_;     // [h] factor on acc_ from this tile's new max
  std::vector<char> scalar_;        // [h] the tile went through ScalarTile
  std::vector<char> finite_;        // [h] every z̃_t, z̃_t ± c_t of the tile is finite
  std::vector<double> pending_;     // [h][Pending][lane] sums not yet in the partial
  BlockCache k_block_, v_block_;
};

void AttendRangeFast(cache::KvStore::Reader& reader, const float* q, int group, int head_dim, std::int64_t begin,
                     std::int64_t end, const BoundContext& ctx, std::vector<HeadPartial>& partials, bool meter) {
  FastAttention(reader, q, group, head_dim, ctx, meter).Run(begin, end, partials);
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::attn
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace witcert::attn {

HWY_EXPORT(AttendRangeFast);
HWY_EXPORT(DitherValuesFast);

void attend_range_fast(cache::KvStore::Reader& reader, const float* q, int group, int head_dim, std::int64_t begin,
                       std::int64_t end, const BoundContext& ctx, std::vector<HeadPartial>& partials, bool meter) {
  HWY_DYNAMIC_DISPATCH(AttendRangeFast)(reader, q, group, head_dim, begin, end, ctx, partials, meter);
}

void dither_values_fast(const quant::DitherStream& stream, std::uint32_t counter, std::span<float> xi) {
  HWY_DYNAMIC_DISPATCH(DitherValuesFast)(stream, counter, xi.data(), static_cast<int>(xi.size()));
}

}  // namespace witcert::attn
#endif  // HWY_ONCE
