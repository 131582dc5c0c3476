// The driver of the fused decode attention: one class template over the pair of key and value
// format traits (keys-inl.h, values-inl.h), which walks a token range tile by tile: decode the
// tile's keys once for all query heads of the KV head, their logits z̃_t and bounds c_t, decode the
// values, then per head the softmax and meter update (softmax-inl.h) and the output. The buffers
// live in the caller's Workspace. Included per target after hwy/highway.h; the member functions
// are defined in keys-inl.h, values-inl.h and softmax-inl.h.
#if defined(WITCERT_KERNEL_DRIVER_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_DRIVER_INL_H_
#undef WITCERT_KERNEL_DRIVER_INL_H_
#else
#define WITCERT_KERNEL_DRIVER_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "attention/reference/certified_attention.h"
#include "kvcache/kv_store.h"
#include "cert/round_up.h"
#include "cert/subgaussian.h"
#include "cert/witness.h"
#include "hwy/highway.h"
#include "attention/cpu/codes-inl.h"
#include "attention/cpu/group-inl.h"
#include "attention/cpu/packed-inl.h"
#include "attention/cpu/philox-inl.h"
#include "attention/cpu/simd-inl.h"
#include "attention/cpu/workspace.h"
#include "formats/dither/dither.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

// Whether a partial can take the vector update (softmax-inl.h).
bool Clean(const HeadPartial& p);

template <class Keys, class Values>
class Attention {
 public:
  Attention(Workspace& work, kvcache::KvStore::Reader& reader, const float* q, int group, int d, const BoundContext& ctx, bool meter)
      : rows_kept_(work.head_dim == d),
        work_(work),
        r_(reader),
        cfg_(reader.config()),
        q_(q),
        group_(group),
        d_(d),
        dp_(hwy::RoundUpTo(static_cast<std::size_t>(d), kNF)),
        ctx_(ctx),
        meter_(meter),
        k_kind_(reader.kind(formats::KvSide::key)),
        v_kind_(reader.kind(formats::KvSide::value)),
        G_(d / kGroup),
        B_(cfg_.bands),
        m2_(2 * cfg_.outlier_pairs),
        float_keys_(Keys::kDitherInt8 && cfg_.dither != kvcache::DitherMode::per_slot) {
    work_.keys.block.block = work_.values.block.block = -1;  // a decoded block of another call's store
    work_.head_dim = d_;
    work_.segments.reserve(kTile / kNF + 1);  // a tile's most pages (ExtendTile): no growth mid-call
    // A tile's pages, with the page before it, span at most kTile + 3P positions of each side: the
    // ring holds twice that for both sides, and one more page for its wrap.
    const std::size_t P = static_cast<std::size_t>(cfg_.page_size);
    if (reader.code_bits(formats::KvSide::key) < 8 || reader.code_bits(formats::KvSide::value) < 8)
      work_.unpacked.resize(std::max(work_.unpacked.size(), (4 * (kTile + 3 * P) + P) * d_));
    work_.query.qd.assign(group_ * dp_, 0.0);
    for (int h = 0; h < group_; ++h)
      for (int c = 0; c < d_; ++c) work_.query.qd[h * dp_ + c] = q_[h * d_ + c];
    // η_t per unit of Σ_c |q_c k'_{t,c}|: tiles in double, and tiles of shared-ξ dither-int8 keys in
    // float (docs/proofs/float-path.md).
    const double float_roundings = std::max(kGroup / kChains + G_ + 5, m2_ + G_ + 2);
    const double eta = ctx_.sm * (d_ + 64) * 0x1p-52;
    const double eta_float = ctx_.sm * (float_roundings * 0x1p-24 * (1.0 + 0x1p-16) + (d_ + 64) * 0x1p-52);
    if (float_keys_) {
      eta0_ = ctx_.sm * (dp_ + 64) * 0x1p-126;  // 2^-150 a rounding would do; 2^-126 keeps it a normal float
      const int blocks = (kTile + static_cast<int>(kNF) - 1) / static_cast<int>(kNF);
      work_.keys.code_blocks.assign(static_cast<std::size_t>(blocks), CodeBlock{});
      work_.keys.tail_codes.assign(static_cast<std::size_t>(blocks) * d_ * kNF, 0);
      work_.keys.outliers_t.assign(static_cast<std::size_t>(blocks) * m2_ * kNF, 0.0f);
      work_.keys.code_dots.assign(static_cast<std::size_t>(group_) * G_ * kTile + kNF, 0.0f);
      work_.keys.meta_f.assign(static_cast<std::size_t>(kTile) * G_, 0.0f);
      work_.keys.outliers_f.assign(static_cast<std::size_t>(kTile) * m2_ + 1, 0.0f);
    }
    if (k_kind_ == kvcache::FormatKind::scheme) {
      const cert::BandLayout bands(d_, B_, cfg_.rope_layout);
      work_.query.qn.resize(static_cast<std::size_t>(group_) * B_);
      work_.query.eta_q.resize(group_);
      for (int h = 0; h < group_; ++h) {
        cert::band_norms(bands, std::span<const float>(q_ + h * d_, d_), std::span<double>(&work_.query.qn[h * B_], B_));
        double norm2 = 0.0;
        for (int c = 0; c < d_; ++c) norm2 += work_.query.qd[h * dp_ + c] * work_.query.qd[h * dp_ + c];
        work_.query.eta_q[h] = eta * std::sqrt(norm2);
      }
      if constexpr (Keys::kPacked) {
        const formats::KvScheme& scheme = *r_.scheme(formats::KvSide::key);
        if (scheme.tokens_per_block() == 1) {
          k_decoder_ = PackedDecoder(scheme.layout(), d_);
          k_row_bytes_ = scheme.block_bytes(d_);
        } else {
          k_group_layout_ = scheme.group_layout();
          k_group_ = group::Decoder(k_group_layout_);
          group::Reserve(work_.keys.group, k_group_layout_, d_, dp_);
        }
        Rows(work_.keys.kfrows);
      }
    }
    if constexpr (Values::kPacked) {
      const formats::KvScheme& scheme = *r_.scheme(formats::KvSide::value);
      v_decoder_ = PackedDecoder(scheme.layout(), d_);
      v_row_bytes_ = scheme.block_bytes(d_);
    }
    if constexpr (Keys::kDitherInt8) {
      const std::uint8_t* mask = r_.outlier_mask();
      work_.query.outliers.clear();
      for (int c = 0; c < d_; ++c)
        if (mask[c]) work_.query.outliers.push_back(c);
      // ς_t² = (sm²/12)·Σ_g s_{g,t}²·Σ_{c∈g, non-outlier} q_c² (Lemma 2, the sum regrouped by g).
      work_.query.q2.assign(static_cast<std::size_t>(group_) * G_, 0.0);
      work_.query.qbar.assign(group_ * dp_, 0.0);
      work_.query.eta_g.assign(work_.query.q2.size(), 0.0);
      work_.query.eta_x.assign(group_, 0.0);
      for (int h = 0; h < group_; ++h)
        for (int c = 0; c < d_; ++c) {
          const double qc = work_.query.qd[h * dp_ + c];
          if (mask[c]) {
            work_.query.eta_x[h] = std::max(work_.query.eta_x[h], eta * std::fabs(qc));
            continue;
          }
          work_.query.q2[h * G_ + c / kGroup] += qc * qc;
          work_.query.eta_g[h * G_ + c / kGroup] += eta * 128.0 * std::fabs(qc);
          work_.query.qbar[h * dp_ + c] = qc;
        }
      if (float_keys_) {
        work_.query.qbar_f.assign(work_.query.qbar.begin(), work_.query.qbar.end());
        // Head blocks of CodeDots: block h0 holds nh = min(kCodeHeads, group − h0) heads, [c][nh].
        work_.query.qbarf.assign(group_ * dp_, 0.0f);
        for (int h0 = 0; h0 < group_; h0 += kCodeHeads) {
          const int nh = std::min(kCodeHeads, group_ - h0);
          for (int j = 0; j < nh; ++j)
            for (int c = 0; c < d_; ++c) work_.query.qbarf[h0 * dp_ + c * nh + j] = static_cast<float>(work_.query.qbar[(h0 + j) * dp_ + c]);
        }
        // Before the outlier pairs are fixed (the first calibration_tokens positions) the mask is
        // empty and every key is served exact: work_.query.q_out stays zero.
        work_.query.q_out.assign(static_cast<std::size_t>(group_) * m2_, 0.0f);
        for (int h = 0; h < group_; ++h)
          for (std::size_t j = 0; j < work_.query.outliers.size(); ++j) work_.query.q_out[h * m2_ + j] = q_[h * d_ + work_.query.outliers[j]];
      }
      work_.keys.scales.assign(static_cast<std::size_t>(kTile) * G_, 0.0);
      work_.keys.outlier_values.assign(static_cast<std::size_t>(kTile) * m2_, 0.0);
      v2_scale_ = ctx_.sm * ctx_.sm / 12.0 * cert::kRoundUpMargin;
      // subgaussian_radius is sqrt(ς²)·κ with κ its value at ς² = 1: evaluated once per call.
      kappa_ = cert::subgaussian_radius(1.0, ctx_.S, ctx_.delta_loc, r_.non_outlier_channels());
      stream_ = r_.dither_stream();
      work_.keys.xi.assign(dp_ + 4 * kNF, 0.0f);
      work_.keys.key_row.assign(d_, 0);
      work_.keys.words.assign(work_.keys.xi.size(), 0);
      work_.keys.s.assign(static_cast<std::size_t>(G_) * kTile, 0.0);
      work_.keys.s2.assign(work_.keys.s.size(), 0.0);
      if (float_keys_) {
        work_.keys.sf.assign(static_cast<std::size_t>(G_) * kTile + kNF, 0.0f);
        work_.keys.s2f.assign(work_.keys.sf.size(), 0.0f);
        work_.keys.poison.assign(kTile + kNF, 0.0f);
        work_.keys.tile_s2_max.assign(G_, 0.0f);
        work_.keys.key_s2_max.assign(G_, 0.0f);
        work_.keys.x_out_max.assign(kNF, 0.0f);
        work_.heads.chains.assign(static_cast<std::size_t>(group_) * kChainCount * kNF, 0.0f);
        work_.heads.chain_steps.assign(group_, 0);
        work_.heads.chain_a_max.assign(static_cast<std::size_t>(group_) * kNF, 0.0f);
        work_.heads.l_mixed.assign(group_, 0);
        const std::size_t segments = kTile / kNF + 1;
        work_.keys.qgf.assign(segments * group_ * G_, 0.0f);
        work_.keys.page_counter.assign(segments, -1);
        work_.keys.block_segment.assign(segments, 0);
        work_.keys.key_meta_buf.resize(static_cast<std::size_t>(kTile) * G_);
        work_.keys.key_outliers_buf.resize(static_cast<std::size_t>(kTile) * m2_);
        work_.query.eta_gf.clear();
        work_.query.eta_xf.clear();
        work_.query.cq2f.clear();
        work_.query.ceta_gf.clear();
        work_.query.ceta_xf.clear();
        for (double e : work_.query.eta_g) work_.query.eta_gf.push_back(static_cast<float>(e * (eta_float / eta)));
        for (double e : work_.query.eta_x) work_.query.eta_xf.push_back(static_cast<float>(e * (eta_float / eta)));
        // c_t ≤ a_t + η' with a_t = sqrt(Σ_g cq2_g s_g²) (FloatWeights, Radii) and
        // η' = ceta0 + ceta_x·max_t x_out + Σ_g ceta_g·max_t s_g (EtaBound): (sqrt(ς_t²)·κ + η_t)·(1 + 2^-17)
        // up to the rounding of each coefficient to float and of the ≤ G + 2 float operations of a_t
        // (relative 2^-24 each, G + 3 < 128).
        constexpr double up = 1.0 + 0x1p-17;
        for (double q2 : work_.query.q2) work_.query.cq2f.push_back(static_cast<float>(q2 * v2_scale_ * kappa_ * kappa_ * up * up));
        for (double e : work_.query.eta_g) work_.query.ceta_gf.push_back(static_cast<float>(e * (eta_float / eta) * up));
        for (double e : work_.query.eta_x) work_.query.ceta_xf.push_back(static_cast<float>(e * (eta_float / eta) * up));
        ceta0f_ = static_cast<float>(eta0_ * up);
        work_.logits.zf.assign(static_cast<std::size_t>(group_) * kTile + kNF, 0.0f);
        work_.logits.cf.assign(work_.logits.zf.size(), 0.0f);
        work_.logits.z_max.assign(group_, 0.0);
        work_.logits.xf.assign(kTile + kNF, 0.0f);
      }
    }
    if (k_kind_ == kvcache::FormatKind::scheme) {
      work_.keys.w_band.assign(static_cast<std::size_t>(B_) * kTile, 0.0);
      work_.keys.band_row.assign(B_, 0.0);
    }
    Rows(work_.keys.krows);
    work_.keys.kfloat.assign(dp_, 0.0f);
    Rows(work_.values.vrows);
    work_.values.v_rho_f.assign(kTile + kNF, 0.0f);
    if constexpr (Values::kDitherInt8) {
      work_.values.v_scalesf.assign(static_cast<std::size_t>(kTile) * G_, 0.0f);
      work_.values.v_s_tf.assign(work_.values.v_scalesf.size() + kN, 0.0f);
      rho_factor_ = RhoFactor();
      work_.values.ws.assign(static_cast<std::size_t>(kValueHeads) * (4 * kNF / kGroup + 1) * kTile, 0.0f);
      work_.values.code_sq.assign(static_cast<std::size_t>(G_) * kTile * kNF, 0.0f);
      work_.values.code_sum.assign(static_cast<std::size_t>(G_) * kTile + kNF, 0.0f);
      value_stream_ = formats::value_stream(r_.dither_stream());
      work_.values.xi.assign(dp_ + 4 * kNF, 0.0f);
      work_.values.words.assign(work_.values.xi.size(), 0);
    }
    work_.keys.mu.assign(kTile, 0.0);
    work_.keys.x_out.assign(kTile, 0.0);
    work_.values.rho.assign(kTile, 0.0);
    work_.values.vnorm.assign(kTile, 0.0);
    work_.logits.z.assign(static_cast<std::size_t>(group_) * kTile, 0.0);
    work_.logits.c.assign(work_.logits.z.size(), 0.0);
    work_.logits.w.assign(work_.logits.z.size(), 0.0f);
    work_.heads.acc.assign(group_ * dp_, 0.0);
    work_.logits.rescale.assign(group_, 1.0);
    work_.logits.finite.assign(group_, 1);
    work_.heads.pending.assign(static_cast<std::size_t>(group_) * kPendings * kN, 0.0);
    work_.logits.scalar.assign(group_, 0);
  }

  void Run(std::int64_t begin, std::int64_t end, std::vector<HeadPartial>& partials) {
    partials.resize(group_);
    for (int h = 0; h < group_; ++h) {
      partials[h].acc.resize(d_, 0.0);
      std::copy_n(partials[h].acc.begin(), d_, &work_.heads.acc[h * dp_]);
    }
    kvcache::KvStore::Reader::RawPage page;
    page.end = page.begin = -1;
    int n = 0;
    for (std::int64_t t0 = begin; t0 < end; t0 += n) {
      if (t0 >= page.end) page = Unpacked(r_.raw_page(t0));
      n = static_cast<int>(std::min<std::int64_t>({kTile, end - t0, page.end - t0}));
      const bool k_packed = t0 < page.k.packed_end, v_packed = t0 < page.v.packed_end;
      if (k_packed) n = static_cast<int>(std::min<std::int64_t>(n, page.k.packed_end - t0));
      if (v_packed) n = static_cast<int>(std::min<std::int64_t>(n, page.v.packed_end - t0));
      shared_tile_ = t0 < page.shared_end;  // a tile's keys share one ξ, or each has its own
      if (shared_tile_) n = static_cast<int>(std::min<std::int64_t>(n, page.shared_end - t0));
      float_tile_ = float_keys_ && k_packed && shared_tile_;
      work_.segments.assign(1, Segment{page, static_cast<std::size_t>(t0 - page.begin), 0, n});
      if (float_tile_ && v_packed && Values::kDitherInt8) n = ExtendTile(t0, end, n, page);
      const RawPage& first = work_.segments[0].page;  // the tile's first page (page: its last)
      LoadKeys(first, t0, n, k_packed);
      if (float_tile_) AllCodeDots(n);
      for (int h = 0; h < group_; ++h) Logits(h, n);
      LoadValues(first, t0, n, v_packed);
      bool any_scalar = false;
      for (int h = 0; h < group_; ++h) {
        work_.logits.scalar[h] = !work_.logits.finite[h] || !Clean(partials[h]);
        any_scalar = any_scalar || work_.logits.scalar[h];
      }
      if (any_scalar && meter_) ValueNorms();  // ScalarTile reads ‖v̂_t‖
      for (int h = 0; h < group_; ++h) {
        HeadPartial& p = partials[h];
        if (work_.logits.scalar[h]) {
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
          v_max = MaxOfSums(work_.values.vnorm.data(), work_.values.rho.data(), n);
        }
        for (int h = 0; h < group_; ++h)
          if (!work_.logits.scalar[h]) partials[h].v_max = std::max(partials[h].v_max, v_max);
      }
    }
    for (int h = 0; h < group_; ++h) {
      Flush(h, partials[h]);
      std::copy_n(&work_.heads.acc[h * dp_], d_, partials[h].acc.begin());
    }
  }

 private:
  using KeyKind = kvcache::KeyBound::Kind;
  using RawPage = kvcache::KvStore::Reader::RawPage;
  using BlockCache = Workspace::BlockCache;
  using CodeBlock = Workspace::CodeBlock;
  using Segment = Workspace::Segment;

  // The page with its codes below 8 bits unpacked into the workspace's ring (the rows the kernel
  // reads: a key page's channels hold its rows, so it is unpacked whole).
  RawPage Unpacked(RawPage page) {
    auto unpack = [&](kvcache::KvStore::Reader::RawSide& side, bool key) {
      if (side.code_run == nullptr || side.packed_end <= page.begin) return;
      const std::size_t n = static_cast<std::size_t>(key ? page.end - page.begin : side.packed_end - page.begin) * d_;
      if (work_.unpacked_at + n > work_.unpacked.size()) work_.unpacked_at = 0;
      std::int8_t* out = work_.unpacked.data() + work_.unpacked_at;
      UnpackCodes(side.code_run, side.code_bits, n, out);
      side.codes = out;
      work_.unpacked_at += n;
    };
    unpack(page.k, true);
    unpack(page.v, false);
    return page;
  }

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
      if (stop <= at) break;  // the next tile reads this page (and unpacks it) itself
      page = Unpacked(next);
      work_.segments.push_back(Segment{page, static_cast<std::size_t>(at - page.begin), n, static_cast<int>(stop - at)});
      n = static_cast<int>(stop - t0);
    }
    return n;
  }

  // Keys (keys-inl.h): double rows k'_t, or the codes of shared-ξ dither-int8 keys, and what bounds
  // their logit error, in token lanes.
  void LoadKeys(const kvcache::KvStore::Reader::RawPage& page, std::int64_t t0, int n, bool packed);
  void PackedKeyRows(const kvcache::KvStore::Reader::RawPage& page, std::size_t row0, std::int64_t t0, int n);
  void GatherKeyMeta();
  void PageDither(std::size_t s);
  void DoubleKeyMeta(int n);
  void KeyTileFloat(int n);
  void DitherKey(const kvcache::KvStore::Reader::RawPage& page, std::size_t row, std::int64_t pos, int i);
  void SharedDither(std::uint32_t counter, float* qg);
  void Logits(int h, int n);
  template <int NH>
  HWY_INLINE void CodeDots(int h0, int n);
  HWY_INLINE void AllCodeDots(int n);
  HWY_INLINE void LogitsFloat(int h, int n);
  double RadiusSquaredMax(int h) const;
  HWY_INLINE VF RadiusSquared(int h, const float* s2, std::size_t step) const;
  void Radii(int h, int n);
  void DoubleLogits(int h, int n);
  void FloatRow(const float* src, double* out) const;
  void DecodeScheme(const formats::KvScheme& scheme, formats::KvSide side, const std::uint8_t* packed, std::size_t row,
                    std::int64_t pos, float* out, BlockCache& cache) const;

  // Values (values-inl.h): float rows or dither-int8 codes, ρ_t and ‖v̂_t‖ in token lanes, and the
  // output's accumulation.
  void LoadValues(const kvcache::KvStore::Reader::RawPage& page, std::int64_t t0, int n, bool packed);
  void DitherValues();
  void DitheredValueRows();
  void RowNorms(int n);
  void RhoDouble();
  float RhoFactor() const;
  void ValueNorms();
  void ValueRows();
  template <bool kSquares>
  void DecodeValueRows();
  void AccumulateAll(int n);
  template <int NH>
  void AccumulateHeads(const int* heads, int n);
  template <std::size_t K, int NH>
  HWY_INLINE void AccumulateColumns(const int* heads, int n, std::size_t c);
  template <std::size_t K, int NH>
  HWY_INLINE void AddToAccumulators(const int* heads, std::size_t c, const VF (&sum)[NH][K]);
  template <int NH>
  void AccumulateCodeHeads(const int* heads, int n);
  template <std::size_t K, int NH>
  HWY_INLINE void AccumulateCodeColumns(const int* heads, int n, std::size_t c);
  void F16FloatRow(const f16* src, float* out) const { F16ToFloat(src, d_, out); }

  // Softmax, output and meter statistics of one query head over the tile (softmax-inl.h).
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
  enum Pending { kL, kRho, kRho2, kPlus, kMinus, kCMax, kMomW, kMom1, kMom2, kPendings };
  double* pending(int h, Pending what) { return &work_.heads.pending[(h * kPendings + what) * kN]; }

  // A float tile: the weights w_t = e^{z̃_t − m} in float from x_t = z̃_t − m rounded to float
  // (|Δx_t| ≤ 2^-24(1 + 2^-28)|x_t|) and Highway's Exp (≤ 1 ulp; 2^-20 is taken), so
  // w'_t = w_t(1 + ε_t) with |ε_t| ≤ 2^-20 + 2^-24(1 + 2^-20)|x_t|, or |w'_t − w_t| ≤ 2^-125 where
  // e^{x_t} underflows; the same w'_t enter LSE(z̃) and the moment sums, and
  // MeterStats::float_c_max accounts for it.
  //
  // With the meter on, the tokens are moment tokens (cert::MeterStats::add_moment): per float lane
  // three FMA chains X1 = Σ w'_t a_t, X2 = Σ w'_t a_t² and X3 = Σ w'_t ρ^v_t (ρ^v_t ≥ 0: the value
  // side's Σ w ρ) that run on across tiles (work_.heads.chains) until
  // Flush folds them into the partial, at most kChainSteps steps later. Every term is nonnegative,
  // so a chain of k rounding steps (its FMAs, and a rescale by MoveMax, with the factor rounded up)
  // is within (1 − 2^-24)^-k of its exact sum, plus at most 2^-150 a step whose rounding underflows.
  // (a_t² is taken as v2_t, the float whose rounded square root is a_t: within 2^-23 of a_t², and
  // v2_t carries the same 1 + 2^-17 as a_t.) Flush widens them by 1 + (k + 2)·2^-23 and
  // kNF·k·2^-146, and adds η' for η_t. Σ w'_t over their tokens is the pending kL, in double: Update
  // folds the chains before it adds other weights there, and UpdateFloat folds those before a
  // chain starts (work_.heads.l_mixed).
  static constexpr int kChainSteps = 64;
  static constexpr std::size_t kChainCount = 3;  // X1, X2 and Σ w'_t ρ^v_t
  double TileMax(int h, int n, double sign) const;
  void LseTile(cert::Lse& L, int h, int n, double sign) const;
  void Flush(int h, HeadPartial& p);
  void MoveMax(int h, double mz, bool shared_reference, HeadPartial& p);
  void Update(int h, int n, HeadPartial& p);
  template <bool kMeter>
  void UpdateFloat(int h, int n, HeadPartial& p);
  template <bool kMeter>
  HWY_INLINE void FloatWeights(int h, int n);
  double EtaBound(int h) const;
  void ScalarTile(int h, int n, HeadPartial& p);

  // The [t][dp] row buffers of a tile, zeroed only when the head dimension changes: a tile writes
  // channels [0, d) of its rows, the padding channels stay zero, and rows past the tile's end only
  // feed lanes the tile masks. Zeroing their 64 to 128 KiB on every call showed in decode profiles.
  template <class T>
  void Rows(std::vector<T>& rows) {
    if (!rows_kept_ || rows.size() != kTile * dp_) rows.assign(kTile * dp_, T{});
  }

  const bool rows_kept_;  // the workspace's last call had this head dimension
  Workspace& work_;
  kvcache::KvStore::Reader& r_;
  const kvcache::CacheConfig& cfg_;
  const float* q_;
  const int group_, d_;
  const std::size_t dp_;  // row stride: d rounded up to whole float vectors, padded with zeros
  const BoundContext ctx_;
  const bool meter_;
  const kvcache::FormatKind k_kind_, v_kind_;
  const int G_, B_, m2_;  // scale groups, bands, outlier channels
  const bool float_keys_;  // dither-int8 keys that may share ξ: tiles of shared-ξ keys take the float path
  bool shared_tile_ = false;  // the tile's keys share their page's ξ
  bool float_tile_ = false;   // the tile takes the float path

  // Per call.
  double eta0_ = 0.0;  // η_t's allowance for underflow in the float products
  float ceta0f_ = 0.0f;
  double v2_scale_ = 0.0, kappa_ = 0.0;
  formats::DitherStream stream_;
  formats::DitherStream value_stream_;  // dithered values' own stream (formats::value_stream)
  float rho_factor_ = 0.0f;
  PackedRowDecoder k_decoder_ = nullptr, v_decoder_ = nullptr;  // packed per-token schemes (PackedKeys, PackedValues)
  std::size_t k_row_bytes_ = 0, v_row_bytes_ = 0;
  group::RowsFn k_group_ = nullptr;  // a packed group scheme's keys (PackedKeys)
  formats::GroupLayout k_group_layout_ = formats::GroupLayout::opaque;

  // Per tile.
  KeyKind key_kind_ = KeyKind::exact;
  const f16* key_meta_ = nullptr;      // the tile's witness rows or dither scale rows
  const f16* key_outliers_ = nullptr;  // the tile's dither-int8 outlier values
  bool value_codes_ = false;           // the tile's values are dither-int8 codes: AccumulateCodeHeads
  bool rows_ready_ = true;             // work_.values.vrows holds the tile's v̂_t
  bool norms_pending_ = false;         // work_.values.vnorm of a dither-int8 value tile not computed yet (ValueNorms)
  double stored_v_max_ = -1.0;         // max_t (‖v̂_t‖ + ρ_t) of the tile from its pages; < 0: none
  double tile_rho_max_ = 0.0;          // max_t ρ^v_t over the tile
  bool rho_double_pending_ = false;    // work_.values.rho not filled from work_.values.v_rho_f yet (RhoDouble)
};

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_DRIVER_INL_H_
