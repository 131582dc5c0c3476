// The value side of the kernel (included per target after hwy/highway.h): the value format traits
// and the driver's members that decode a tile's values, their ρ_t and ‖v̂_t‖, and accumulate
// Σ_t w_t v̂_t into the output.
#if defined(WITCERT_KERNEL_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_VALUES_INL_H_
#undef WITCERT_KERNEL_VALUES_INL_H_
#else
#define WITCERT_KERNEL_VALUES_INL_H_
#endif

#include "hwy/highway.h"
#include "attention/cpu/driver-inl.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

// Value formats. DecodedValues: fp16, or a registry scheme decoded by formats::KvScheme::decode into
// float rows, ρ_t from its stored witness. DitherInt8Values: s_g·code, accumulated from the codes
// (AVX-512) or float rows, ρ_t from the scales.
struct DecodedValues {
  static constexpr bool kDitherInt8 = false, kPacked = false;
};
// PackedValues: a per-token scheme with a formats::PackedLayout, decoded into the same float rows by
// its SIMD decoder (packed-inl.h).
struct PackedValues {
  static constexpr bool kDitherInt8 = false, kPacked = true;
};
struct DitherInt8Values {
  static constexpr bool kDitherInt8 = true, kPacked = false;
};

template <class Keys, class Values>
void Attention<Keys, Values>::LoadValues(const kvcache::KvStore::Reader::RawPage& page, std::int64_t t0, int n, bool packed) {
  const std::size_t row0 = static_cast<std::size_t>(t0 - page.begin);
  value_codes_ = false;
  rows_ready_ = true;
  norms_pending_ = false;
  stored_v_max_ = -1.0;
  // ρ_t in float (work_.values.v_rho_f: exact, an fp16 value, 0 past the tile; DitherValues' own), and in double
  // only where a double path of the meter reads it (RhoDouble). tile_rho_max_: max(0, max_t ρ_t), a
  // NaN ρ_t left out (as DitherValues).
  rho_double_pending_ = meter_;
  tile_rho_max_ = 0.0;
  if (!packed) {
    for (int i = 0; i < n; ++i) F16FloatRow(page.v.exact + (row0 + i) * d_, &work_.values.vrows[i * dp_]);
    std::fill(work_.values.v_rho_f.begin(), work_.values.v_rho_f.end(), 0.0f);
  } else if (v_kind_ == kvcache::FormatKind::scheme) {
    const formats::KvScheme& scheme = *r_.scheme(formats::KvSide::value);
    for (int i = 0; i < n; ++i) {
      if constexpr (Values::kPacked)
        v_decoder_(page.v.packed + (row0 + i) * v_row_bytes_, d_, &work_.values.vrows[i * dp_]);
      else
        DecodeScheme(scheme, formats::KvSide::value, page.v.packed, row0 + i, t0 + i, &work_.values.vrows[i * dp_],
                     work_.values.block);
      work_.values.v_rho_f[i] = fp16_to_float(page.v.meta[row0 + i]);
      tile_rho_max_ = std::max(tile_rho_max_, static_cast<double>(work_.values.v_rho_f[i]));
    }
    std::fill(work_.values.v_rho_f.begin() + n, work_.values.v_rho_f.end(), 0.0f);
  } else {
    DitherValues();
    return;
  }
  if (meter_) RowNorms(n);
}

// ‖v̂_t‖ of the tile's n float rows into work_.values.vnorm.
template <class Keys, class Values>
void Attention<Keys, Values>::RowNorms(int n) {
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN))
    hn::StoreU(hn::Sqrt(SquaredNorms(&work_.values.vrows[j0 * dp_], dp_, dp_)), DD(), &work_.values.vnorm[j0]);
}

// dither-int8 values: v̂ = s_g·code, exact in float (11 × 8 bits). The rows are not decoded here on
// AVX-512 (kValueCodes): AccumulateCodeHeads takes Σ_t w_t v̂_t from the codes, and ValueRows
// decodes the rows only for a head that takes ScalarTile. With the meter on, ρ_t here in token
// lanes, and max_t(‖v̂_t‖ + ρ_t) from the pages when the tile holds them whole; otherwise ‖v̂_t‖
// later (ValueNorms): ‖v̂_t‖² = Σ_g s_g²·C_{t,g} with C_{t,g} = Σ_{c∈g} code_c², an integer below
// 2^24 and so exact in float in any order: per token and group a vector whose lanes sum to
// C_{t,g} (CodeSquares), reduced kNF tokens at a time.
template <class Keys, class Values>
void Attention<Keys, Values>::DitherValues() {
  // Locals: the stores below would otherwise make the compiler reload every member per vector.
  const int G = G_;
  float* HWY_RESTRICT scales = work_.values.v_scalesf.data();
  float* HWY_RESTRICT s_tf = work_.values.v_s_tf.data();
  for (const Segment& seg : work_.segments)
    F16ToFloat(seg.page.v.meta + seg.row0 * G, seg.n * G, scales + seg.i0 * G);
  value_codes_ = kValueCodes;
  rows_ready_ = false;
  const int n = work_.segments.back().i0 + work_.segments.back().n;
  // The scales in token lanes; lanes past the tile's end repeat its last token (finite ρ_t and
  // ‖v̂_t‖ there, whatever a past tile held; their C_{t,g} is 0).
  PadRows(scales, G, n);
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) SplitChannels(scales, G, j0, s_tf + j0, kTile);
  const bool dithered = work_.segments[0].page.v.dithered;
  if (dithered) DitheredValueRows();  // float rows, and their norms with the meter on
  if (!meter_) {  // the V-side terms belong to the meter
    if (dithered) return;
    if constexpr (!kValueCodes) DecodeValueRows<false>();
    return;
  }
  // |v̂ − v| ≤ s/2 per channel plus the float rounding of the decode, as in the Reader:
  // ρ_t = sqrt(Σ_g s_g²)·sqrt(32)·(½ + 2^-17), in float with RhoFactor rounded up, which also
  // covers the float roundings (Σ_g s_g², the square root, the product).
  const DF df;
  const VF rho_factor = hn::Set(df, rho_factor_);  // RhoFactor()
  float* HWY_RESTRICT rho_f = work_.values.v_rho_f.data();
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
  norms_pending_ = !dithered;
  // A tile that holds every packed token of its pages takes max_t (‖v̂_t‖ + ρ_t) from the pages
  // (KvStore keeps it at write time, as value_norm_bound computes it, rounded up); others, and
  // ScalarTile, compute ‖v̂_t‖ (ValueNorms).
  double stored = 0.0;
  for (const Segment& seg : work_.segments) {
    const RawPage& pg = seg.page;
    const bool whole = seg.row0 == 0 && pg.begin + seg.n == pg.v.packed_end && pg.v.norm_max != nullptr &&
                       std::isfinite(*pg.v.norm_max);
    stored = whole ? std::max(stored, static_cast<double>(*pg.v.norm_max)) : -1.0;
    if (!whole) break;
  }
  stored_v_max_ = stored;
  if constexpr (!kValueCodes)
    if (!dithered) DecodeValueRows<true>();  // the float codes' squares come with the rows
}

// Values with their own dither (one tile, one page: their keys take no float tiles): v̂_t =
// s_{t,g}·(code_t − ξ_t), ξ_t from the values' Philox stream at the token's slot counter, formed in
// double (exact) and rounded once to float, as formats::decode_dither does; ‖v̂_t‖ from the rows.
template <class Keys, class Values>
void Attention<Keys, Values>::DitheredValueRows() {
  value_codes_ = false;
  rows_ready_ = true;
  const DD dd;
  const hn::Rebind<std::int8_t, DD> di8;
  const hn::Rebind<std::int32_t, DD> di32;
  const float* HWY_RESTRICT scales = work_.values.v_scalesf.data();
  float* HWY_RESTRICT xi = work_.values.xi.data();
  for (const Segment& seg : work_.segments) {
    const std::int8_t* codes = seg.page.v.codes + seg.row0 * d_;
    for (int i = seg.i0; i < seg.i0 + seg.n; ++i, codes += d_) {
      DitherRow(value_stream_, seg.page.slot_counter + static_cast<std::uint32_t>(seg.row0 + (i - seg.i0)), d_, xi,
                work_.values.words.data());
      float* row = &work_.values.vrows[i * dp_];
      for (int g = 0; g < G_; ++g) {
        const VD s = hn::Set(dd, scales[i * G_ + g]);
        for (int c = g * kGroup; c < (g + 1) * kGroup; c += static_cast<int>(kN)) {
          const VD x = hn::Sub(hn::PromoteTo(dd, hn::PromoteTo(di32, hn::LoadU(di8, codes + c))),
                               hn::PromoteTo(dd, hn::LoadU(DFH(), xi + c)));
          hn::StoreU(hn::DemoteTo(DFH(), hn::Mul(x, s)), DFH(), row + c);
        }
      }
    }
  }
  norms_pending_ = false;
  if (meter_) RowNorms(work_.segments.back().i0 + work_.segments.back().n);
}

// ρ_t of the value tile in double (work_.values.rho), once per tile and only for the paths that read it.
template <class Keys, class Values>
void Attention<Keys, Values>::RhoDouble() {
  if (!rho_double_pending_) return;
  rho_double_pending_ = false;
  const DD dd;
  const int n = work_.segments.back().i0 + work_.segments.back().n;
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN))
    hn::StoreU(hn::PromoteTo(dd, hn::LoadU(DFH(), &work_.values.v_rho_f[j0])), dd, &work_.values.rho[j0]);
}

// sqrt(32)·(½ + 2^-17)·(1 + (G + 4)·2^-24) rounded up to float: kv_store's ρ_t per unit of
// sqrt(Σ_g s_g²), with room for DitherValues' float roundings (G/2 + 2 relative at most).
template <class Keys, class Values>
float Attention<Keys, Values>::RhoFactor() const {
  return cert::float_round_up(std::sqrt(static_cast<double>(kGroup)) * (0.5 + 0x1p-17) * (1.0 + (G_ + 4) * 0x1p-24));
}

// ‖v̂_t‖ of a dither-int8 value tile into work_.values.vnorm, once per tile and only where needed (a tile
// that does not hold whole pages, or a head's ScalarTile): on AVX-512 after AccumulateAll, while
// the tile's codes are still in the L1 cache, with each kNF tokens' code squares summed across
// lanes in registers.
template <class Keys, class Values>
void Attention<Keys, Values>::ValueNorms() {
  if (!norms_pending_) return;
  norms_pending_ = false;
  const DD dd;
  const DF df;
  const int G = G_;
  const int n = work_.segments.back().i0 + work_.segments.back().n;
  float* HWY_RESTRICT code_sum = work_.values.code_sum.data();
  const float* HWY_RESTRICT s_tf = work_.values.v_s_tf.data();
  for (int g = 0; g < G; ++g)
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
      if constexpr (kValueCodes) {  // integer lanes: exact, converted once the lanes are summed
        const DI di;
        VI sums[kNF];
        // A lane block lies in one segment (ExtendTile): its tokens' codes are rows d apart.
        const Segment* seg = work_.segments.data();
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
        const float* HWY_RESTRICT code_sq = work_.values.code_sq.data();
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
    hn::StoreU(hn::Sqrt(norm2), dd, &work_.values.vnorm[j0]);
  }
}

// The tile's dither-int8 value rows v̂_t = s_{t,g}·code_t in work_.values.vrows, for ScalarTile (kValueCodes):
// decoded once, on the first head that needs them.
template <class Keys, class Values>
void Attention<Keys, Values>::ValueRows() {
  if (!rows_ready_) DecodeValueRows<false>();
}

// work_.values.vrows from the codes and work_.values.v_scalesf; with kSquares also work_.values.code_sq (as CodeSquares, from the
// float codes).
template <class Keys, class Values>
template <bool kSquares>
void Attention<Keys, Values>::DecodeValueRows() {
  rows_ready_ = true;
  const DF df;
  const hn::Rebind<std::int8_t, DF> d8;
  const hn::Rebind<std::int32_t, DF> d32;
  const int G = G_, d = d_;  // locals: the stores would otherwise make the compiler reload members
  const std::size_t dp = dp_;
  const float* HWY_RESTRICT scales = work_.values.v_scalesf.data();
  float* HWY_RESTRICT rows = work_.values.vrows.data();
  float* HWY_RESTRICT code_sq = work_.values.code_sq.data();
  for (const Segment& seg : work_.segments) {
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

// Σ_t w_t v̂_t over the tile in float, added to each vector-path head's double accumulator; up to
// kHeadBlock heads share one pass over the value rows.
template <class Keys, class Values>
void Attention<Keys, Values>::AccumulateAll(int n) {
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
    if (work_.logits.scalar[h]) continue;
    double* acc = &work_.heads.acc[h * dp_];
    if (work_.logits.rescale[h] != 1.0)
      for (std::size_t c = 0; c < dp_; c += kN) hn::StoreU(hn::Mul(hn::LoadU(dd, acc + c), hn::Set(dd, work_.logits.rescale[h])), dd, acc + c);
    heads[nh++] = h;
    if (nh == block) accumulate();
  }
  accumulate();  // the last block, also when the group's last head took ScalarTile
}

template <class Keys, class Values>
template <int NH>
void Attention<Keys, Values>::AccumulateHeads(const int* heads, int n) {
  std::size_t c = 0;
  for (; c + 4 * kNF <= dp_; c += 4 * kNF) AccumulateColumns<4, NH>(heads, n, c);
  for (; c < dp_; c += kNF) AccumulateColumns<1, NH>(heads, n, c);
}

// Columns [c, c + K·kNF) of NH heads: NH·K independent FMA chains over the tile's tokens.
template <class Keys, class Values>
template <std::size_t K, int NH>
HWY_INLINE void Attention<Keys, Values>::AccumulateColumns(const int* heads, int n, std::size_t c) {
  const DF df;
  VF sum[NH][K];
  for (auto& s : sum)
    for (VF& x : s) x = hn::Zero(df);
  for (int i = 0; i < n; ++i) {
    const float* row = &work_.values.vrows[i * dp_ + c];
    VF r[K];
    for (std::size_t k = 0; k < K; ++k) r[k] = hn::LoadU(df, row + k * kNF);
    for (int j = 0; j < NH; ++j) {
      const VF w = hn::Set(df, work_.logits.w[heads[j] * kTile + i]);
      for (std::size_t k = 0; k < K; ++k) sum[j][k] = hn::MulAdd(w, r[k], sum[j][k]);
    }
  }
  AddToAccumulators<K, NH>(heads, c, sum);
}

// The tile's float sums of columns [c, c + K·kNF) added to the NH heads' double accumulators.
template <class Keys, class Values>
template <std::size_t K, int NH>
HWY_INLINE void Attention<Keys, Values>::AddToAccumulators(const int* heads, std::size_t c, const VF (&sum)[NH][K]) {
  const DD dd;
  const DF df;
  for (int j = 0; j < NH; ++j) {
    double* acc = &work_.heads.acc[heads[j] * dp_];
    HWY_ALIGN float o[K * kNF];
    for (std::size_t k = 0; k < K; ++k) hn::Store(sum[j][k], df, o + k * kNF);
    for (std::size_t x = 0; x < K * kNF; x += kN)
      hn::StoreU(hn::Add(hn::LoadU(dd, acc + c + x), hn::PromoteTo(dd, hn::LoadU(DFH(), o + x))), dd, acc + c + x);
  }
}

// dither-int8 values straight from their codes: Σ_t w_t v̂_{t,c} = Σ_t (w_t·s_{t,g})·code_{t,c}, the
// codes converted once for all NH heads and the products w_t·s_{t,g} formed in token lanes (one
// more float rounding per term than the float rows' path).
template <class Keys, class Values>
template <int NH>
void Attention<Keys, Values>::AccumulateCodeHeads(const int* heads, int n) {
  constexpr std::size_t K = ValueColumns(NH);
  std::size_t c = 0;
  for (; c + K * kNF <= static_cast<std::size_t>(d_); c += K * kNF) AccumulateCodeColumns<K, NH>(heads, n, c);
  for (; c < static_cast<std::size_t>(d_); c += kNF) AccumulateCodeColumns<1, NH>(heads, n, c);
}

// Columns [c, c + K·kNF) of NH heads, which span KG groups from c's; work_.values.ws[(j·KG + g)·kTile + t] =
// w_t·s_{t,g} of head j and the pass's group g (a pass of K > 1 blocks starts on a group).
template <class Keys, class Values>
template <std::size_t K, int NH>
HWY_INLINE void Attention<Keys, Values>::AccumulateCodeColumns(const int* heads, int n, std::size_t c) {
  constexpr std::size_t KG = (K * kNF + kGroup - 1) / kGroup;
  static_assert(!kValueCodes || K == 1 || K * kNF % kGroup == 0);  // never called without kValueCodes
  const DF df;
  const hn::Rebind<std::int8_t, DF> d8;
  const hn::Rebind<std::int32_t, DF> d32;
  float* HWY_RESTRICT ws = work_.values.ws.data();
  for (int j = 0; j < NH; ++j)
    for (std::size_t g = 0; g < KG; ++g) {
      const float* w = &work_.logits.w[heads[j] * kTile];
      const float* s = &work_.values.v_s_tf[(c / kGroup + g) * kTile];
      for (int i0 = 0; i0 < n; i0 += static_cast<int>(kNF))
        hn::StoreU(hn::Mul(hn::LoadU(df, w + i0), hn::LoadU(df, s + i0)), df, ws + (j * KG + g) * kTile + i0);
    }
  VF sum[NH][K];
  for (auto& s : sum)
    for (VF& x : s) x = hn::Zero(df);
  for (const Segment& seg : work_.segments) {
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

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_VALUES_INL_H_
