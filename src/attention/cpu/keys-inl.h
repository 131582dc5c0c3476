// The key side of the kernel (included per target after hwy/highway.h): the key format traits and
// the driver's members that decode a tile's keys and compute its logits z̃_t and bounds c_t.
#if defined(WITCERT_KERNEL_KEYS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_KEYS_INL_H_
#undef WITCERT_KERNEL_KEYS_INL_H_
#else
#define WITCERT_KERNEL_KEYS_INL_H_
#endif

#include "hwy/highway.h"
#include "attention/cpu/driver-inl.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

// Key formats. DecodedKeys: fp16, or a registry scheme decoded by formats::KvScheme::decode into
// double rows, bounded by its Tier A witness (Theorem 2). DitherInt8Keys: s_g·(code − ξ) with
// the Tier B bound (Lemma 2), in double rows with a per-slot ξ, or on the float path where the
// page shares one ξ (the proof: docs/proofs/float-path.md).
struct DecodedKeys {
  static constexpr bool kDitherInt8 = false, kPacked = false;
};
// PackedKeys: a per-token scheme with a formats::PackedLayout or a group scheme with a
// formats::GroupLayout, decoded a tile at a time into float rows by its SIMD decoder (packed-inl.h,
// group-inl.h); the logits are DecodedKeys' to the bit.
struct PackedKeys {
  static constexpr bool kDitherInt8 = false, kPacked = true;
};
struct DitherInt8Keys {
  static constexpr bool kDitherInt8 = true, kPacked = false;
};

template <class Keys, class Values>
void Attention<Keys, Values>::LoadKeys(const kvcache::KvStore::Reader::RawPage& page, std::int64_t t0, int n, bool packed) {
  const std::size_t row0 = static_cast<std::size_t>(t0 - page.begin);
  if (!packed) {
    key_kind_ = KeyKind::exact;
    for (int i = 0; i < n; ++i) F16ToDouble(page.k.exact + (row0 + i) * d_, d_, &work_.keys.krows[i * dp_]);
    return;
  }
  if (k_kind_ == kvcache::FormatKind::scheme) {
    key_kind_ = KeyKind::tier_a;
    key_meta_ = page.k.meta + row0 * B_;
    if constexpr (Keys::kPacked) {  // float rows, read as double by Logits
      PackedKeyRows(page, row0, t0, n);
    } else {
      const formats::KvScheme& scheme = *r_.scheme(formats::KvSide::key);
      for (int i = 0; i < n; ++i) {
        DecodeScheme(scheme, formats::KvSide::key, page.k.packed, row0 + i, t0 + i, work_.keys.kfloat.data(), work_.keys.block);
        FloatRow(work_.keys.kfloat.data(), &work_.keys.krows[i * dp_]);
      }
    }
    if (!meter_) return;
    for (int i = 0; i < n; ++i) {
      F16ToDouble(key_meta_ + i * B_, B_, work_.keys.band_row.data());
      for (int b = 0; b < B_; ++b) work_.keys.w_band[b * kTile + i] = work_.keys.band_row[b];
    }
    const DD dd;
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
      // ‖k̂_t‖ in double: the float rows promote exactly, so both paths compute the same norms.
      const VD norm2 = Keys::kPacked ? SquaredNorms(&work_.keys.kfrows[j0 * dp_], dp_, dp_)
                                     : SquaredNorms(&work_.keys.krows[j0 * dp_], dp_, dp_);
      hn::StoreU(hn::Sqrt(norm2), dd, &work_.keys.mu[j0]);
    }
    return;
  }
  key_kind_ = KeyKind::tier_b;
  key_meta_ = page.k.meta + row0 * G_;
  key_outliers_ = page.k.outlier_values + row0 * m2_;
  if (float_tile_) {  // every shared-ξ tile of dither-int8 keys
    if (work_.segments.size() > 1) GatherKeyMeta();
    for (std::size_t s = 0; s < work_.segments.size(); ++s) PageDither(s);
    return KeyTileFloat(n);
  }
  DoubleKeyMeta(n);
  for (int i = 0; i < n; ++i)
    for (int g = 0; g < G_; ++g) {
      work_.keys.s[g * kTile + i] = work_.keys.scales[i * G_ + g];
      work_.keys.s2[g * kTile + i] = work_.keys.scales[i * G_ + g] * work_.keys.scales[i * G_ + g];
    }
  for (int i = 0; i < n; ++i) DitherKey(page, row0 + i, t0 + i, i);
}

// The tile's packed keys into float rows: a per-token scheme row by row, a group scheme a run of
// each block's tokens at a time (its block split once per run).
template <class Keys, class Values>
void Attention<Keys, Values>::PackedKeyRows(const kvcache::KvStore::Reader::RawPage& page, std::size_t row0, std::int64_t t0,
                                            int n) {
  float* rows = work_.keys.kfrows.data();
  if (k_group_ == nullptr) {
    for (int i = 0; i < n; ++i) k_decoder_(page.k.packed + (row0 + i) * k_row_bytes_, d_, rows + i * dp_);
    return;
  }
  for (int i = 0; i < n;) {
    const std::int64_t pos = t0 + i;
    const int first = static_cast<int>(pos % group::kTokens), count = std::min(group::kTokens - first, n - i);
    const std::uint8_t* block = r_.group_block(formats::KvSide::key, pos / group::kTokens);
    group::Prepare(k_group_layout_, block, d_, work_.keys.group);
    k_group_(block, d_, work_.keys.group, first, count, rows + i * dp_, dp_);
    i += count;
  }
}

// A tile of several pages: its key scales and outlier values copied into one run, [t][g] and [t][j],
// as a one-page tile finds them in its page.
template <class Keys, class Values>
void Attention<Keys, Values>::GatherKeyMeta() {
  for (const Segment& seg : work_.segments) {
    std::copy_n(seg.page.k.meta + seg.row0 * G_, seg.n * G_, &work_.keys.key_meta_buf[seg.i0 * G_]);
    if (m2_ > 0)
      std::copy_n(seg.page.k.outlier_values + seg.row0 * m2_, seg.n * m2_, &work_.keys.key_outliers_buf[seg.i0 * m2_]);
  }
  key_meta_ = work_.keys.key_meta_buf.data();
  key_outliers_ = work_.keys.key_outliers_buf.data();
}

// Q_g of segment s's page into its slot of work_.keys.qgf: kept from the last tile, or computed.
template <class Keys, class Values>
void Attention<Keys, Values>::PageDither(std::size_t s) {
  const std::uint32_t counter = work_.segments[s].page.page_counter;
  if (work_.keys.page_counter[s] == counter) return;
  const std::size_t slot = static_cast<std::size_t>(group_) * G_;
  for (std::size_t s2 = s + 1; s2 < work_.keys.page_counter.size(); ++s2)
    if (work_.keys.page_counter[s2] == counter) {
      std::copy_n(&work_.keys.qgf[s2 * slot], slot, &work_.keys.qgf[s * slot]);
      work_.keys.page_counter[s] = counter;
      return;
    }
  SharedDither(counter, &work_.keys.qgf[s * slot]);
  work_.keys.page_counter[s] = counter;
}

// The tile's key scales and outlier values as double, [t][g] and [t][j] (contiguous in the page):
// the double path's, and the float path's when a tile falls back to ScalarTile.
template <class Keys, class Values>
void Attention<Keys, Values>::DoubleKeyMeta(int n) {
  F16ToDouble(key_meta_, n * G_, work_.keys.scales.data());
  if (m2_ > 0) F16ToDouble(key_outliers_, n * m2_, work_.keys.outlier_values.data());
}

// Shared-page dither: where the tile's codes lie with the tokens in lanes (work_.keys.code_blocks[b]: kNF
// bytes of channel c at codes + c·stride, token b·kNF + lane; CodeDots converts them to float),
// its scales (work_.keys.sf[g][t]) and outlier values (work_.keys.outliers_t[b][j][lane]) likewise; with the meter on,
// the squared scales (work_.keys.s2f), the tile's largest s_g² (work_.keys.tile_s2_max, for Update's choice of
// weights) and, for EtaBound, the call's running maxima of s_g² (work_.keys.key_s2_max) and of
// Σ_j |x_{t,j}| (per lane, work_.keys.x_out_max). Lanes past the tile repeat its last token, so they move no
// maximum.
template <class Keys, class Values>
void Attention<Keys, Values>::KeyTileFloat(int n) {
  const DF df;
  const std::size_t P = static_cast<std::size_t>(cfg_.page_size);
  // Scales and outlier values are token-major in the page: converted in one go, the last token
  // repeated up to a whole lane block, then split into channels with the tokens in lanes.
  float* HWY_RESTRICT meta = work_.keys.meta_f.data();
  float* HWY_RESTRICT outl = work_.keys.outliers_f.data();
  F16ToFloat(key_meta_, n * G_, meta);
  if (m2_ > 0) F16ToFloat(key_outliers_, n * m2_, outl);
  PadRows(meta, G_, n);
  PadRows(outl, m2_, n);
  const Segment* seg = work_.segments.data();
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
    // data(), not [·]: with m = 0 the vector is empty.
    float* xo = work_.keys.outliers_t.data() + static_cast<std::size_t>(j0 / static_cast<int>(kNF)) * m2_ * kNF;
    VF x_out = hn::Zero(df);
    if (m2_ > 0) SplitChannels(outl, m2_, j0, xo, kNF);
    for (int j = 0; j < m2_; ++j) x_out = hn::Add(x_out, hn::Abs(hn::LoadU(df, xo + j * kNF)));
    if (meter_ && m2_ > 0) hn::StoreU(hn::Max(hn::LoadU(df, work_.keys.x_out_max.data()), x_out), df, work_.keys.x_out_max.data());
    // A non-finite stored value makes every query head's logit NaN ("no guarantee"): an infinite
    // scale times a finite code sum would pass for a token of weight 0.
    auto bad = hn::Not(hn::IsFinite(x_out));
    SplitChannels(meta, G_, j0, &work_.keys.sf[j0], kTile);
    for (int g = 0; g < G_; ++g) {
      const VF sg = hn::LoadU(df, &work_.keys.sf[g * kTile + j0]);
      bad = hn::Or(bad, hn::Not(hn::IsFinite(sg)));
    }
    hn::StoreU(hn::IfThenElseZero(bad, hn::Set(df, NAN)), df, &work_.keys.poison[j0]);
    // The keys are channel-major inside a page: kNF consecutive bytes of channel c are the codes
    // of kNF consecutive tokens. A block that would read past the page is copied first (lanes
    // past the tile repeat its last token).
    const std::size_t b = static_cast<std::size_t>(j0) / kNF;
    while (j0 >= seg->i0 + seg->n) ++seg;  // a block lies in one segment (ExtendTile)
    work_.keys.block_segment[b] = static_cast<int>(seg - work_.segments.data());
    const std::size_t row = seg->row0 + static_cast<std::size_t>(j0 - seg->i0);
    const std::int8_t* page_codes = seg->page.k.codes;
    CodeBlock& block = work_.keys.code_blocks[b];
    block.codes = page_codes + row;
    block.stride = P;
    if (row + kNF > P) {  // the tile's last block
      std::int8_t* tail = &work_.keys.tail_codes[b * d_ * kNF];
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
      const VF sg = hn::LoadU(df, &work_.keys.sf[g * kTile + j0]);
      const VF s2 = hn::Mul(sg, sg);  // exact: 22 significant bits
      hn::StoreU(s2, df, &work_.keys.s2f[g * kTile + j0]);
      s2_max = hn::Max(s2_max, s2);
    }
    work_.keys.tile_s2_max[g] = hn::GetLane(hn::MaxOfLanes(df, s2_max));
    work_.keys.key_s2_max[g] = std::max(work_.keys.key_s2_max[g], work_.keys.tile_s2_max[g]);
  }
}

// k'_t = s_g·(code − ξ_t) with the token's own (per-slot) dither, the fp16 outliers in place; exact
// in double. Keys that share their page's ξ take the float path instead.
template <class Keys, class Values>
void Attention<Keys, Values>::DitherKey(const kvcache::KvStore::Reader::RawPage& page, std::size_t row, std::int64_t pos, int i) {
  const DD dd;
  const hn::Rebind<std::int8_t, DD> di8;
  const hn::Rebind<std::int32_t, DD> di32;
  const std::size_t P = static_cast<std::size_t>(cfg_.page_size);
  for (int c = 0; c < d_; ++c) work_.keys.key_row[c] = page.k.codes[c * P + row];  // channel-major in the page
  const std::int8_t* codes = work_.keys.key_row.data();
  DitherRow(stream_, page.counter(pos), d_, work_.keys.xi.data(), work_.keys.words.data());
  double* out = &work_.keys.krows[i * dp_];
  for (int g = 0; g < G_; ++g) {
    const VD s = hn::Set(dd, work_.keys.scales[i * G_ + g]);
    for (int c = g * kGroup; c < (g + 1) * kGroup; c += static_cast<int>(kN)) {
      VD x = hn::PromoteTo(dd, hn::PromoteTo(di32, hn::LoadU(di8, codes + c)));
      x = hn::Sub(x, hn::PromoteTo(dd, hn::LoadU(DFH(), &work_.keys.xi[c])));
      hn::StoreU(hn::Mul(x, s), dd, out + c);
    }
  }
  const double* outlier_values = work_.keys.outlier_values.data() + i * m2_;  // m = 0: empty
  double x_out = 0.0;
  for (int j = 0; j < m2_; ++j) {
    out[work_.query.outliers[j]] = outlier_values[j];
    x_out += std::fabs(outlier_values[j]);
  }
  work_.keys.x_out[i] = x_out;
}

// Shared-page dither (float tiles only): ξ of the page and Q_g = Σ_{c∈g, non-outlier} q_c ξ_c per
// query head ([h][g] into qg), once per page, in float: the group's channels in lanes, kQChains
// FMA chains summed pairwise, then kNF (head, group) pairs at a time across the lanes
// (TransposeSum). A term passes through at most kQgRoundings roundings, no more than a code sum's
// kGroup/kChains + 2 that η_t covers (docs/proofs/float-path.md).
template <class Keys, class Values>
void Attention<Keys, Values>::SharedDither(std::uint32_t counter, float* qg) {
  const DF df;
  DitherRow(stream_, counter, d_, work_.keys.xi.data(), work_.keys.words.data());
  const float* HWY_RESTRICT xi = work_.keys.xi.data();
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
    const float* HWY_RESTRICT q = &work_.query.qbar_f[h * dp_];
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
template <class Keys, class Values>
void Attention<Keys, Values>::Logits(int h, int n) {
  if (float_tile_) return LogitsFloat(h, n);
  const DD dd;
  const double* q = &work_.query.qd[h * dp_];
  // Packed Tier A keys: their float rows, read as double.
  const bool float_rows = Keys::kPacked && key_kind_ == KeyKind::tier_a;
  auto finite = hn::FirstN(dd, kN);
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
    // Shared-ξ dither keys never come here.
    const VD dot = float_rows ? DotRows(q, &work_.keys.kfrows[j0 * dp_], dp_, dp_)
                              : DotRows(q, &work_.keys.krows[j0 * dp_], dp_, dp_);
    hn::StoreU(hn::Mul(hn::Set(dd, ctx_.sm), dot), dd, &work_.logits.z[h * kTile + j0]);
    VD c = hn::Zero(dd);
    if (meter_ && key_kind_ == KeyKind::tier_a) {
      // Theorem 2: c_t = sm·Σ_b ‖q_b‖·w_{t,b}.
      VD sum = hn::Zero(dd);
      for (int b = 0; b < B_; ++b)
        sum = hn::MulAdd(hn::Set(dd, work_.query.qn[h * B_ + b]), hn::LoadU(dd, &work_.keys.w_band[b * kTile + j0]), sum);
      c = hn::MulAdd(sum, hn::Set(dd, ctx_.sm * cert::kRoundUpMargin),
                     hn::Mul(hn::Set(dd, work_.query.eta_q[h]), hn::LoadU(dd, &work_.keys.mu[j0])));
    } else if (meter_ && key_kind_ == KeyKind::tier_b) {
      // Lemma 2: u_t = sqrt(ς_t²)·κ; then η_t.
      VD v2 = hn::Zero(dd), eta = hn::Mul(hn::Set(dd, work_.query.eta_x[h]), hn::LoadU(dd, &work_.keys.x_out[j0]));
      for (int g = 0; g < G_; ++g) {
        v2 = hn::MulAdd(hn::Set(dd, work_.query.q2[h * G_ + g]), hn::LoadU(dd, &work_.keys.s2[g * kTile + j0]), v2);
        eta = hn::MulAdd(hn::Set(dd, work_.query.eta_g[h * G_ + g]), hn::LoadU(dd, &work_.keys.s[g * kTile + j0]), eta);
      }
      c = hn::MulAdd(hn::Sqrt(hn::Mul(v2, hn::Set(dd, v2_scale_))), hn::Set(dd, kappa_), eta);
    }
    hn::StoreU(c, dd, &work_.logits.c[h * kTile + j0]);
    const VD z = hn::LoadU(dd, &work_.logits.z[h * kTile + j0]);
    const auto ok = hn::And(hn::IsFinite(hn::Add(z, c)), hn::And(hn::IsFinite(z), hn::IsFinite(hn::Sub(z, c))));
    finite = hn::And(finite, hn::Or(ok, hn::Not(hn::FirstN(dd, static_cast<std::size_t>(n - j0)))));
  }
  work_.logits.finite[h] = hn::AllTrue(dd, finite);
}

// Σ_{c∈g} q̄_c·code_{t,c} of every group g, for NH query heads from h0 in one pass over the
// tile's codes (kChains FMA chains per head and group), into work_.keys.code_dots.
template <class Keys, class Values>
template <int NH>
void Attention<Keys, Values>::CodeDots(int h0, int n) {
  const DF df;
  const hn::Rebind<std::int8_t, DF> di8;
  const hn::Rebind<std::int32_t, DF> di32;
  const float* HWY_RESTRICT q = &work_.query.qbarf[h0 * dp_];  // [c][NH]
  float* HWY_RESTRICT out = &work_.keys.code_dots[h0 * G_ * kTile];
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
    const CodeBlock& block = work_.keys.code_blocks[static_cast<std::size_t>(j0) / kNF];
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

template <class Keys, class Values>
void Attention<Keys, Values>::AllCodeDots(int n) {
  for (int h0 = 0; h0 < group_; h0 += kCodeHeads)
    WithHeads<kCodeHeads>(std::min(kCodeHeads, group_ - h0), [&]<int NH>() { CodeDots<NH>(h0, n); });
}

// Shared-page dither-int8 keys, in float with the tile's tokens in lanes:
//   z̃_t = sm·(q·k'_t − Σ_g Q_g s_{g,t}).
// The radii come with the weights (UpdateFloat) or from Radii.
template <class Keys, class Values>
void Attention<Keys, Values>::LogitsFloat(int h, int n) {
  const DF df;
  const VF sm = hn::Set(df, static_cast<float>(ctx_.sm));
  VF probe = hn::Zero(df);  // ±inf or NaN in a lane where some z̃_t is not finite
  VF z_max = hn::Set(df, -HUGE_VALF);
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF)) {
    const std::size_t b = static_cast<std::size_t>(j0) / kNF;
    const float* qg = &work_.keys.qgf[(static_cast<std::size_t>(work_.keys.block_segment[b]) * group_ + h) * G_];
    VF dot = hn::Zero(df);
    for (int j = 0; j < m2_; ++j)
      dot = hn::MulAdd(hn::Set(df, work_.query.q_out[h * m2_ + j]), hn::LoadU(df, &work_.keys.outliers_t[(b * m2_ + j) * kNF]), dot);
    for (int g = 0; g < G_; ++g) {
      const VF sg = hn::LoadU(df, &work_.keys.sf[g * kTile + j0]);
      const VF code_dot = hn::LoadU(df, &work_.keys.code_dots[(h * G_ + g) * kTile + j0]);
      dot = hn::MulAdd(sg, hn::Sub(code_dot, hn::Set(df, qg[g])), dot);
    }
    const VF z = hn::Add(hn::Mul(sm, dot), hn::LoadU(df, &work_.keys.poison[j0]));  // NaN where a stored value is not finite
    const auto valid = hn::FirstN(df, static_cast<std::size_t>(n - j0));
    z_max = hn::Max(z_max, hn::IfThenElse(valid, z, z_max));
    hn::StoreU(z, df, &work_.logits.zf[h * kTile + j0]);
    probe = hn::Add(probe, hn::IfThenElseZero(valid, hn::Abs(z)));
  }
  work_.logits.finite[h] = hn::AllTrue(df, hn::IsFinite(probe));
  work_.logits.z_max[h] = hn::GetLane(hn::MaxOfLanes(df, z_max));
}

// ≥ max_t a_t² over head h's float tile, from the tile's largest s_g² (KeyTileFloat), widened past
// the float roundings of a_t²: Update's choice between float and double weights. It bounds no sum.
template <class Keys, class Values>
double Attention<Keys, Values>::RadiusSquaredMax(int h) const {
  double v2 = 0.0;
  for (int g = 0; g < G_; ++g) v2 += static_cast<double>(work_.query.cq2f[h * G_ + g]) * work_.keys.tile_s2_max[g];
  return v2 * (1.0 + 0x1p-20);
}

// a_t² = Σ_g cq2_g s_{g,t}² (v2_t) of kNF tokens in lanes, s2[g·step + lane] = s_{g,t}²: the factors
// sm²/12, κ² and (1 + 2^-17)² are folded into work_.query.cq2f (the constructor), so that a_t = sqrt(v2_t) is
// sqrt(ς_t²)·κ·(1 + 2^-17) up to float rounding (docs/proofs/float-path.md); η_t enters through η'
// (EtaBound).
template <class Keys, class Values>
HWY_INLINE VF Attention<Keys, Values>::RadiusSquared(int h, const float* s2, std::size_t step) const {
  const DF df;
  VF v2 = hn::Zero(df);
  for (int g = 0; g < G_; ++g) v2 = hn::MulAdd(hn::Set(df, work_.query.cq2f[h * G_ + g]), hn::LoadU(df, s2 + g * step), v2);
  return v2;
}

// a_t of head h's tokens into work_.logits.cf, for DoubleLogits. Lanes past the tile's end repeat its last
// token (PadRows).
template <class Keys, class Values>
void Attention<Keys, Values>::Radii(int h, int n) {
  const DF df;
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kNF))
    hn::StoreU(hn::Sqrt(RadiusSquared(h, &work_.keys.s2f[j0], kTile)), df, &work_.logits.cf[h * kTile + j0]);
}

// A float tile's z̃_t as double, and c_t ≤ a_t + η' (rounded up), for Update's double weights and
// ScalarTile; c_t = 0 in the lanes past the tile's end.
template <class Keys, class Values>
void Attention<Keys, Values>::DoubleLogits(int h, int n) {
  const double eta = meter_ ? EtaBound(h) : 0.0;
  if (meter_) Radii(h, n);
  for (int i = 0; i < n; ++i) {
    work_.logits.z[h * kTile + i] = work_.logits.zf[h * kTile + i];
    work_.logits.c[h * kTile + i] = (work_.logits.cf[h * kTile + i] + eta) * (1.0 + 0x1p-50);
  }
  std::fill(&work_.logits.c[h * kTile + n], &work_.logits.c[h * kTile] + hwy::RoundUpTo(static_cast<std::size_t>(n), kN), 0.0);
}

template <class Keys, class Values>
void Attention<Keys, Values>::FloatRow(const float* src, double* out) const {
  const DD dd;
  for (std::size_t c = 0; c < dp_; c += kN) hn::StoreU(hn::PromoteTo(dd, hn::LoadU(DFH(), src + c)), dd, out + c);
}

// One token of a scheme side into out (d floats): a per-token scheme decodes its own bytes, a
// group scheme its whole block once.
template <class Keys, class Values>
void Attention<Keys, Values>::DecodeScheme(const formats::KvScheme& scheme, formats::KvSide side, const std::uint8_t* packed, std::size_t row,
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

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_KEYS_INL_H_
