#include "attn/certified_attention.h"

#include <algorithm>
#include <cmath>

#include "cert/subgaussian.h"
#include "cert/witness.h"

namespace witcert::attn {

void HeadPartial::merge(const HeadPartial& o) {
  if (o.l == 0.0 && o.m == -INFINITY) return;
  const double m_new = std::max(m, o.m);
  const double a = m == -INFINITY ? 0.0 : std::exp(m - m_new), b = std::exp(o.m - m_new);
  if (acc.size() < o.acc.size()) acc.resize(o.acc.size(), 0.0);
  for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = acc[i] * a + o.acc[i] * b;
  l = l * a + o.l * b;
  rho = rho * a + o.rho * b;
  m = m_new;
  v_max = std::max(v_max, o.v_max);
  meter.merge(o.meter);
}

void attend_range_reference(cache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                            std::int64_t begin, std::int64_t end, const BoundContext& ctx,
                            std::vector<HeadPartial>& partials) {
  const int d = head_dim;
  const cache::CacheConfig& cfg = reader.config();
  const cert::BandLayout bands(d, cfg.bands, cfg.rope_layout);
  // Per query: band norms ‖q_b‖ for Tier A.
  std::vector<double> q_norms(static_cast<std::size_t>(group) * cfg.bands);
  for (int h = 0; h < group; ++h)
    cert::band_norms(bands, std::span<const float>(q + h * d, d), std::span<double>(&q_norms[h * cfg.bands], cfg.bands));
  partials.resize(group);
  for (HeadPartial& p : partials) p.acc.resize(d, 0.0);
  std::vector<float> k(d), v(d);
  cache::KeyBound bound;
  for (std::int64_t t = begin; t < end; ++t) {
    reader.key(t, k.data(), bound);
    double rho = 0.0;
    reader.value(t, v.data(), rho);
    double v_norm = 0.0;
    for (int i = 0; i < d; ++i) v_norm += double(v[i]) * v[i];
    v_norm = std::sqrt(v_norm);
    for (int h = 0; h < group; ++h) {
      const float* qh = q + h * d;
      double dot = 0.0;
      for (int i = 0; i < d; ++i) dot += double(qh[i]) * k[i];
      const double z = ctx.sm * dot;
      double c = 0.0;
      if (bound.kind == cache::KeyBound::tier_a) {
        c = cert::tier_a_c(std::span<const double>(&q_norms[h * cfg.bands], cfg.bands),
                           std::span<const f16>(bound.witness, cfg.bands), ctx.sm);
      } else if (bound.kind == cache::KeyBound::tier_b) {
        const double v2 = cert::dither_variance_proxy(std::span<const float>(qh, d),
                                                      std::span<const f16>(bound.scales, d / quant::kDefaultGroup),
                                                      std::span<const std::uint8_t>(reader.outlier_mask(), d),
                                                      quant::kDefaultGroup, ctx.sm);
        c = cert::subgaussian_radius(v2, ctx.S, ctx.delta_loc, reader.non_outlier_channels());
      }
      HeadPartial& p = partials[h];
      p.meter.add(z, c);
      if (!std::isfinite(z)) {  // NaN or Inf in q or k̂: the meter already reads "no guarantee"
        p.m = std::isnan(z) ? NAN : std::max(p.m, z);
        continue;
      }
      if (z > p.m) {
        const double scale = std::exp(p.m - z);
        for (double& a : p.acc) a *= scale;
        p.l *= scale;
        p.rho *= scale;
        p.m = z;
      }
      const double w = std::exp(z - p.m);
      for (int i = 0; i < d; ++i) p.acc[i] += w * v[i];
      p.l += w;
      p.rho += w * rho;
      p.v_max = std::max(p.v_max, v_norm + rho);
    }
  }
}

HeadResult finish(const HeadPartial& p, int head_dim, float* out) {
  HeadResult r;
  for (int i = 0; i < head_dim; ++i) out[i] = static_cast<float>(p.acc[i] / p.l);
  const double log_A = p.meter.log_A(), log_A_minus = p.meter.log_A_minus();
  r.eform_raw = cert::eform_raw(log_A);
  const double shapes = std::min({r.eform_raw, cert::two_sided_raw(log_A, log_A_minus),
                                  cert::tanh_half_shape(p.meter.c_max)});
  r.meter = std::isnan(log_A) || std::isnan(p.m) ? 1.0 : cert::clamp_meter(shapes);
  const double weighted_rho = p.rho / p.l;
  r.v_meter = cert::value_meter(weighted_rho, p.v_max);
  r.output_bound = cert::value_output_bound(r.meter, p.v_max, weighted_rho);
  if (std::isnan(p.m) || !(p.l > 0.0)) {
    r.eform_raw = INFINITY;
    r.meter = 1.0;
    r.v_meter = INFINITY;
    r.output_bound = INFINITY;
  }
  return r;
}

double true_tv(cache::KvStore::Reader& reader, const float* q, int head_dim, std::int64_t n_ctx) {
  const int d = head_dim;
  const double sm = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> z(n_ctx), z_hat(n_ctx);
  std::vector<float> k(d);
  cache::KeyBound bound;
  for (std::int64_t t = 0; t < n_ctx; ++t) {
    double a = 0.0, b = 0.0;
    reader.exact_key(t, k.data());
    for (int i = 0; i < d; ++i) a += double(q[i]) * k[i];
    reader.key(t, k.data(), bound);
    for (int i = 0; i < d; ++i) b += double(q[i]) * k[i];
    z[t] = sm * a;
    z_hat[t] = sm * b;
  }
  const double mz = *std::max_element(z.begin(), z.end()), mh = *std::max_element(z_hat.begin(), z_hat.end());
  double sz = 0.0, sh = 0.0;
  for (std::int64_t t = 0; t < n_ctx; ++t) sz += std::exp(z[t] - mz), sh += std::exp(z_hat[t] - mh);
  double tv = 0.0;
  for (std::int64_t t = 0; t < n_ctx; ++t) tv += std::fabs(std::exp(z[t] - mz) / sz - std::exp(z_hat[t] - mh) / sh);
  return 0.5 * tv;
}

}  // namespace witcert::attn
