// Softmax and meter of the kernel (included per target after hwy/highway.h): per query head over a
// tile, the weights e^{z̃_t − m}, LSE(z̃), LSE(z̃ ± c) or the moment sums of c_t, Σ p̃_t ρ_t and
// max_t(‖v̂_t‖ + ρ_t), with the reference's token-by-token update for tiles it cannot vectorize.
#if defined(WITCERT_KERNEL_SOFTMAX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_SOFTMAX_INL_H_
#undef WITCERT_KERNEL_SOFTMAX_INL_H_
#else
#define WITCERT_KERNEL_SOFTMAX_INL_H_
#endif

#include "hwy/highway.h"
#include "attention/cpu/driver-inl.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

// The vector update needs a partial whose statistics are finite and in step (p.m and p.l are
// LSE(z̃)'s m and s, up to the pending sums); anything else takes the reference's token-by-token
// path.
bool Clean(const HeadPartial& p) {
  const auto ok = [](double m) { return !std::isnan(m) && m != kInf; };
  return ok(p.m) && p.meter.z.m == p.m && p.meter.z.s == p.l && ok(p.meter.z_plus_c.m) &&
         ok(p.meter.z_minus_c.m) && !std::isnan(p.meter.c_max);
}

// Max over the tile's valid lanes of x_t (x: the tile's z̃ shifted by sign·c).
template <class Keys, class Values>
double Attention<Keys, Values>::TileMax(int h, int n, double sign) const {
  const DD dd;
  VD mx = hn::Set(dd, -kInf);
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
    const VD x = hn::MulAdd(hn::Set(dd, sign), hn::LoadU(dd, &work_.logits.c[h * kTile + j0]), hn::LoadU(dd, &work_.logits.z[h * kTile + j0]));
    mx = hn::Max(mx, hn::IfThenElse(hn::FirstN(dd, static_cast<std::size_t>(n - j0)), x, mx));
  }
  return hn::GetLane(hn::MaxOfLanes(dd, mx));
}

// LSE_t(z̃_t + sign·c_t) of the tile added to L.
template <class Keys, class Values>
void Attention<Keys, Values>::LseTile(cert::Lse& L, int h, int n, double sign) const {
  const DD dd;
  const double mx = TileMax(h, n, sign);
  if (mx > L.m) {
    L.s *= std::exp(L.m - mx);
    L.m = mx;
  }
  VD sum = hn::Zero(dd);
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
    const VD x = hn::MulAdd(hn::Set(dd, sign), hn::LoadU(dd, &work_.logits.c[h * kTile + j0]), hn::LoadU(dd, &work_.logits.z[h * kTile + j0]));
    const VD e = hn::Exp(dd, hn::Sub(x, hn::Set(dd, L.m)));
    sum = hn::Add(sum, hn::IfThenElseZero(hn::FirstN(dd, static_cast<std::size_t>(n - j0)), e));
  }
  L.s += hn::GetLane(hn::SumOfLanes(dd, sum));
}

template <class Keys, class Values>
void Attention<Keys, Values>::Flush(int h, HeadPartial& p) {
  const DD dd;
  const auto take = [&](Pending what, bool max) {
    const VD v = hn::LoadU(dd, pending(h, what));
    hn::StoreU(hn::Zero(dd), dd, pending(h, what));
    return hn::GetLane(max ? hn::MaxOfLanes(dd, v) : hn::SumOfLanes(dd, v));
  };
  const double l_pending = take(kL, false);
  p.l += l_pending;
  p.meter.z.s = p.l;
  // Only Update writes the other pending sums; since the last Flush it has not, where work_.heads.l_mixed
  // says so, and they are still 0.
  if (!float_keys_ || work_.heads.l_mixed[h]) {
    p.rho += take(kRho, false);
    p.rho2 += take(kRho2, false);
    p.meter.z_plus_c.s += take(kPlus, false);
    p.meter.z_minus_c.s += take(kMinus, false);
    p.meter.c_max = std::max(p.meter.c_max, take(kCMax, true));
    p.meter.mom_w += take(kMomW, false);
    p.meter.mom_c1 += take(kMom1, false);
    p.meter.mom_c2 += take(kMom2, false);
    if (float_keys_) work_.heads.l_mixed[h] = 0;
  }
  if (!float_keys_ || work_.heads.chain_steps[h] == 0) return;
  // The float tiles' moment chains (UpdateFloat), k steps per lane since the last Flush: their
  // lanes added in double (kNF additions of one sign, far inside the widening), widened by
  // F = 1 + (k + 2)·2^-23 and kNF·k·2^-146. With η' ≥ η_t for all their tokens (EtaBound, from
  // the call's running maxima) and L = Σ w'_t over them:
  //   Σ w'_t c_t ≤ X1 + η'·L,   Σ w'_t c_t² ≤ X2 + 2η'·X1 + η'²·L,   c_t ≤ max a_t + η',
  // each widened by 2^-40 for its double roundings.
  float* chain = &work_.heads.chains[static_cast<std::size_t>(h) * kChainCount * kNF];
  const auto lanes = [&](std::size_t i) {  // the lanes of chain i in double
    VD sum = hn::Zero(dd);
    for (std::size_t j = 0; j < kNF; j += kN) sum = hn::Add(sum, hn::PromoteTo(dd, hn::LoadU(DFH(), chain + i * kNF + j)));
    return hn::GetLane(hn::SumOfLanes(dd, sum));
  };
  double x1 = lanes(0), x2 = lanes(1), x3 = lanes(2);
  std::fill_n(chain, kChainCount * kNF, 0.0f);
  const double k = work_.heads.chain_steps[h], widen = 1.0 + (k + 2.0) * 0x1p-23, tiny = static_cast<double>(kNF) * k * 0x1p-146;
  x1 = x1 * widen + tiny;
  x2 = x2 * widen + tiny;
  // Where every ρ^v_t so far was 0 the chain is exactly 0 and takes no underflow allowance; a NaN
  // ρ^v_t (a NaN value scale) stays NaN.
  p.rho += (x3 * widen + (p.float_rho_max > 0.0 ? tiny : 0.0)) * (1.0 + 0x1p-40);
  const double l = l_pending, eta = EtaBound(h);  // the chains' Σ w'_t (work_.heads.l_mixed)
  p.meter.mom_w += l;
  p.meter.mom_c1 += (x1 + eta * l) * (1.0 + 0x1p-40);
  p.meter.mom_c2 += (x2 + 2.0 * eta * x1 + eta * eta * l) * (1.0 + 0x1p-40);
  float* a_lanes = &work_.heads.chain_a_max[static_cast<std::size_t>(h) * kNF];
  const double a_max = hn::GetLane(hn::MaxOfLanes(DF(), hn::LoadU(DF(), a_lanes)));
  std::fill_n(a_lanes, kNF, 0.0f);
  const double c_max = (a_max + eta) * (1.0 + 0x1p-50);
  p.meter.c_max = std::max(p.meter.c_max, c_max);
  p.meter.float_c_max = std::max(p.meter.float_c_max, c_max);
  work_.heads.chain_steps[h] = 0;
}

// A tile whose max logit mz exceeds the head's running max: every sum kept relative to it (the
// partial's, the pending lanes', and LSE(z̃ ± c) while they share its reference point) is rescaled
// by e^{m − mz}, and work_.logits.rescale[h] tells AccumulateAll to do the same to the output.
template <class Keys, class Values>
void Attention<Keys, Values>::MoveMax(int h, double mz, bool shared_reference, HeadPartial& p) {
  const DD dd;
  work_.logits.rescale[h] = 1.0;
  if (!(mz > p.m)) return;
  const double r = work_.logits.rescale[h] = std::exp(p.m - mz);
  p.l *= r;
  p.rho *= r;
  p.rho2 *= r * r;
  for (Pending what : {kL, kRho, kPlus, kMinus, kMomW, kMom1, kMom2})
    hn::StoreU(hn::Mul(hn::LoadU(dd, pending(h, what)), hn::Set(dd, r)), dd, pending(h, what));
  hn::StoreU(hn::Mul(hn::LoadU(dd, pending(h, kRho2)), hn::Set(dd, r * r)), dd, pending(h, kRho2));
  p.meter.mom_w *= r;  // the moment sums are kept at LSE(z̃)'s reference point
  p.meter.mom_c1 *= r;
  p.meter.mom_c2 *= r;
  if (float_keys_ && work_.heads.chain_steps[h] > 0) {  // r rounded up, and one more rounding step
    const DF df;
    const VF r_up = hn::Set(df, cert::float_round_up(r));
    float* chain = &work_.heads.chains[static_cast<std::size_t>(h) * kChainCount * kNF];
    for (std::size_t i = 0; i < kChainCount * kNF; i += kNF) hn::StoreU(hn::Mul(hn::LoadU(df, chain + i), r_up), df, chain + i);
    ++work_.heads.chain_steps[h];
  }
  if (shared_reference) {
    p.meter.z_plus_c.s *= r;
    p.meter.z_minus_c.s *= r;
    p.meter.z_plus_c.m = p.meter.z_minus_c.m = mz;
  }
  p.m = mz;
  p.meter.z.s = p.l;
}

template <class Keys, class Values>
void Attention<Keys, Values>::Update(int h, int n, HeadPartial& p) {
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
  if (float_keys_ && work_.heads.chain_steps[h] > 0) Flush(h, p);  // a chain's Σ w'_t is the pending kL
  VD c_max = hn::Zero(dd);
  if (meter_)
    for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN))
      c_max = hn::Max(c_max, hn::IfThenElseZero(hn::FirstN(dd, static_cast<std::size_t>(n - j0)),
                                                hn::LoadU(dd, &work_.logits.c[h * kTile + j0])));
  hn::StoreU(hn::Max(c_max, hn::LoadU(dd, pending(h, kCMax))), dd, pending(h, kCMax));
  const bool same_reference = plus.m == p.m && minus.m == p.m;
  const bool shared_reference =
      meter_ && same_reference && (moments || hn::AllTrue(dd, hn::Lt(c_max, hn::Set(dd, kSharedReferenceMaxC))));
  if (meter_ && !shared_reference) Flush(h, p);  // LseTile works on the partial itself
  const double mz = TileMax(h, n, 0.0);
  MoveMax(h, mz, shared_reference, p);
  // After the Flushes above (which clear it): the pending sums now take this tile's weights.
  if (float_keys_) work_.heads.l_mixed[h] = 1;
  const VD m = hn::Set(dd, p.m);
  VD l = hn::LoadU(dd, pending(h, kL)), rho = hn::LoadU(dd, pending(h, kRho)), rho2 = hn::LoadU(dd, pending(h, kRho2));
  VD s_plus = hn::LoadU(dd, pending(h, kPlus)), s_minus = hn::LoadU(dd, pending(h, kMinus));
  VD mom_w = hn::LoadU(dd, pending(h, kMomW)), mom_1 = hn::LoadU(dd, pending(h, kMom1)),
     mom_2 = hn::LoadU(dd, pending(h, kMom2));
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) {
    const auto valid = hn::FirstN(dd, static_cast<std::size_t>(n - j0));
    const VD w = hn::IfThenElseZero(valid, hn::Exp(dd, hn::Sub(hn::LoadU(dd, &work_.logits.z[h * kTile + j0]), m)));
    hn::StoreU(hn::DemoteTo(DFH(), w), DFH(), &work_.logits.w[h * kTile + j0]);
    l = hn::Add(l, w);
    if (!meter_) continue;  // the V-side terms belong to the meter
    const VD rho_t = hn::LoadU(dd, &work_.values.rho[j0]), w_rho = hn::Mul(w, rho_t);
    rho = hn::MulAdd(w, rho_t, rho);
    rho2 = hn::MulAdd(w_rho, w_rho, rho2);
    if (moments) {
      const VD c = hn::LoadU(dd, &work_.logits.c[h * kTile + j0]), wc = hn::Mul(w, c);
      mom_w = hn::Add(mom_w, w);
      mom_1 = hn::Add(mom_1, wc);
      mom_2 = hn::MulAdd(wc, c, mom_2);
    } else if (shared_reference) {
      const VD e_c = hn::Exp(dd, hn::LoadU(dd, &work_.logits.c[h * kTile + j0]));
      s_plus = hn::MulAdd(w, e_c, s_plus);
      s_minus = hn::Add(s_minus, hn::Div(w, e_c));
    }
  }
  hn::StoreU(l, dd, pending(h, kL));
  hn::StoreU(rho, dd, pending(h, kRho));
  hn::StoreU(rho2, dd, pending(h, kRho2));
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

template <class Keys, class Values>
template <bool kMeter>
void Attention<Keys, Values>::UpdateFloat(int h, int n, HeadPartial& p) {
  const DD dd;
  if constexpr (kMeter) {
    p.float_rho_max = std::max(p.float_rho_max, tile_rho_max_);
    if (work_.heads.l_mixed[h]) Flush(h, p);  // the chain's Σ w'_t will be the pending kL
  }
  const cert::MeterStats& meter = p.meter;  // LSE(z̃ ± c) move with m while they share it
  MoveMax(h, work_.logits.z_max[h], meter.z_plus_c.m == p.m && meter.z_minus_c.m == p.m, p);
  const VD m = hn::Set(dd, p.m);
  float* x = work_.logits.xf.data();
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN))
    hn::StoreU(hn::DemoteTo(DFH(), hn::Sub(hn::PromoteTo(dd, hn::LoadU(DFH(), &work_.logits.zf[h * kTile + j0])), m)), DFH(), x + j0);
  FloatWeights<kMeter>(h, n);
  const float* w = &work_.logits.w[h * kTile];
  VD l = hn::LoadU(dd, pending(h, kL));
  for (int j0 = 0; j0 < n; j0 += static_cast<int>(kN)) l = hn::Add(l, hn::PromoteTo(dd, hn::LoadU(DFH(), w + j0)));
  hn::StoreU(l, dd, pending(h, kL));
  p.meter.z.m = p.m;
  p.meter.n += n;
  if constexpr (kMeter) {
    work_.heads.chain_steps[h] += (n + static_cast<int>(kNF) - 1) / static_cast<int>(kNF);
    if (work_.heads.chain_steps[h] >= kChainSteps) Flush(h, p);
  }
}

// UpdateFloat's loop: the weights w'_t = e^{x_t} into work_.logits.w and, with the meter on, a_t, a_t² and
// ρ^v_t into the head's chains.
template <class Keys, class Values>
template <bool kMeter>
HWY_INLINE void Attention<Keys, Values>::FloatWeights(int h, int n) {
  const DF df;
  const float* HWY_RESTRICT x = work_.logits.xf.data();
  const float* HWY_RESTRICT s2 = work_.keys.s2f.data();
  const float* HWY_RESTRICT rho = work_.values.v_rho_f.data();
  float* HWY_RESTRICT w = &work_.logits.w[h * kTile];
  float* chain = kMeter ? &work_.heads.chains[static_cast<std::size_t>(h) * kChainCount * kNF] : nullptr;
  VF sum1 = hn::Zero(df), sum2 = hn::Zero(df), sum3 = hn::Zero(df);
  if constexpr (kMeter) {
    sum1 = hn::LoadU(df, chain);
    sum2 = hn::LoadU(df, chain + kNF);
    sum3 = hn::LoadU(df, chain + 2 * kNF);
  }
  // Lanes past the tile's end repeat its last token: they move no maximum.
  float* a_lanes = kMeter ? &work_.heads.chain_a_max[static_cast<std::size_t>(h) * kNF] : nullptr;
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
template <class Keys, class Values>
double Attention<Keys, Values>::EtaBound(int h) const {
  const DF df;
  const double x_out = hn::GetLane(hn::MaxOfLanes(df, hn::LoadU(df, work_.keys.x_out_max.data())));
  double eta = static_cast<double>(ceta0f_) + static_cast<double>(work_.query.ceta_xf[h]) * x_out;
  for (int g = 0; g < G_; ++g)
    eta += static_cast<double>(work_.query.ceta_gf[h * G_ + g]) * std::sqrt(static_cast<double>(work_.keys.key_s2_max[g]));
  return eta * (1.0 + 0x1p-48);
}

// The reference's token-by-token update (certified_attention.cc), for tiles with a non-finite
// logit or bound and for partials already poisoned by one. c_t comes from the cert functions,
// which skip bands and groups the query does not touch.
template <class Keys, class Values>
void Attention<Keys, Values>::ScalarTile(int h, int n, HeadPartial& p) {
  ValueRows();
  RhoDouble();
  if (float_tile_) {
    DoubleKeyMeta(n);
    DoubleLogits(h, n);
  }
  const float* qh = q_ + h * d_;
  double* acc = &work_.heads.acc[h * dp_];
  for (int i = 0; i < n; ++i) {
    const double z = work_.logits.z[h * kTile + i];
    double c = 0.0;
    if (meter_ && key_kind_ == KeyKind::tier_a) {
      c = cert::tier_a_c(std::span<const double>(&work_.query.qn[h * B_], B_), std::span<const f16>(key_meta_ + i * B_, B_),
                         ctx_.sm) +
          work_.query.eta_q[h] * work_.keys.mu[i];
    } else if (meter_ && key_kind_ == KeyKind::tier_b) {
      const double v2 = cert::dither_variance_proxy(std::span<const float>(qh, d_),
                                                    std::span<const f16>(key_meta_ + i * G_, G_),
                                                    std::span<const std::uint8_t>(r_.outlier_mask(), d_), kGroup,
                                                    ctx_.sm);
      // The float path's logits carry its own, larger allowance.
      double x_out = 0.0;  // Σ_{outlier c}|x_{t,c}|, as work_.keys.x_out holds it for the double path
      for (int j = 0; j < m2_; ++j) x_out += std::fabs(work_.keys.outlier_values[i * m2_ + j]);
      double eta = float_tile_ ? eta0_ + work_.query.eta_xf[h] * x_out : work_.query.eta_x[h] * x_out;
      for (int g = 0; g < G_; ++g)
        eta += (float_tile_ ? work_.query.eta_gf[h * G_ + g] : work_.query.eta_g[h * G_ + g]) * work_.keys.scales[i * G_ + g];
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
      p.rho2 *= scale * scale;
      p.m = z;
    }
    const double w = std::exp(z - p.m);
    for (int c2 = 0; c2 < d_; ++c2) acc[c2] += w * work_.values.vrows[i * dp_ + c2];
    p.l += w;
    if (!meter_) continue;
    p.rho += w * work_.values.rho[i];
    p.rho2 += (w * work_.values.rho[i]) * (w * work_.values.rho[i]);
    p.v_max = std::max(p.v_max, work_.values.vnorm[i] + work_.values.rho[i]);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_SOFTMAX_INL_H_
