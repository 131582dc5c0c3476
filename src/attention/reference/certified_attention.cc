#include "attention/reference/certified_attention.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cert/round_up.h"
#include "cert/subgaussian.h"
#include "cert/witness.h"

namespace witcert::attention {

void HeadPartial::merge(const HeadPartial& o) {
  if (o.l == 0.0 && o.m == -INFINITY) return;
  const double m_new = std::max(m, o.m);
  const double a = m == -INFINITY ? 0.0 : std::exp(m - m_new), b = std::exp(o.m - m_new);
  if (acc.size() < o.acc.size()) acc.resize(o.acc.size(), 0.0);
  for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = acc[i] * a + o.acc[i] * b;
  l = l * a + o.l * b;
  rho = rho * a + o.rho * b;
  rho2 = rho2 * (a * a) + o.rho2 * (b * b);
  m = m_new;
  v_max = std::max(v_max, o.v_max);
  float_rho_max = std::max(float_rho_max, o.float_rho_max);
  meter.merge(o.meter);
}

void HeadPartial::add(double z, const float* v, int head_dim, double rho_t, double v_norm) {
  if (!std::isfinite(z)) {  // NaN or Inf in q or k̂: the meter already reads "no guarantee"
    m = std::isnan(z) ? NAN : std::max(m, z);
    return;
  }
  if (z > m) {
    const double scale = std::exp(m - z);
    for (double& a : acc) a *= scale;
    l *= scale;
    rho *= scale;
    rho2 *= scale * scale;
    m = z;
  }
  const double w = std::exp(z - m);
  for (int i = 0; i < head_dim; ++i) acc[i] += w * v[i];
  l += w;
  rho += w * rho_t;
  rho2 += (w * rho_t) * (w * rho_t);
  v_max = std::max(v_max, v_norm + rho_t);
}

namespace {

// c_t for each query head of the group from a token's stored bound: Tier A from the witness
// and ‖q_b‖ (precomputed), Tier B from the dither scales, 0 for exact tokens.
class BoundEvaluator {
 public:
  BoundEvaluator(kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim, const BoundContext& ctx)
      : reader_(reader), q_(q), d_(head_dim), ctx_(ctx), bands_(reader.config().bands) {
    const cert::BandLayout layout(d_, bands_, reader.config().rope_layout);
    q_norms_.resize(static_cast<std::size_t>(group) * bands_);
    for (int h = 0; h < group; ++h)
      cert::band_norms(layout, std::span<const float>(q + h * d_, d_), std::span<double>(&q_norms_[h * bands_], bands_));
  }

  double c(int h, const kvcache::KeyBound& bound) const {
    if (bound.kind == kvcache::KeyBound::tier_a)
      return cert::tier_a_c(std::span<const double>(&q_norms_[h * bands_], bands_),
                            std::span<const f16>(bound.witness, bands_), ctx_.sm);
    if (bound.kind == kvcache::KeyBound::tier_b) {
      const double v2 = cert::dither_variance_proxy(std::span<const float>(q_ + h * d_, d_),
                                                    std::span<const f16>(bound.scales, d_ / bound.scale_group),
                                                    std::span<const std::uint8_t>(reader_.outlier_mask(), d_),
                                                    bound.scale_group, ctx_.sm);
      return cert::subgaussian_radius(v2, ctx_.S, ctx_.delta_loc, reader_.non_outlier_channels());
    }
    if (bound.kind == kvcache::KeyBound::rounded) {
      // |q·(k − k̂)| ≤ Σ_c |q_c|·|k_c − k̂_c|, and |k_c − k̂_c| ≤ s·(½ + 2^-17) on every channel
      // rounded to nearest (the decode's float rounding included); outliers are exact.
      const std::uint8_t* outlier = reader_.outlier_mask();
      double sum = 0.0;
      for (int c = 0; c < d_; ++c)
        if (!outlier[c]) sum += std::fabs(double(q_[h * d_ + c])) * fp16_to_double(bound.scales[c / bound.scale_group]);
      return ctx_.sm * sum * (0.5 + 0x1p-17) * cert::kRoundUpMargin;
    }
    return 0.0;
  }

 private:
  kvcache::KvStore::Reader& reader_;
  const float* q_;
  int d_;
  BoundContext ctx_;
  int bands_;
  std::vector<double> q_norms_;
};

double dot(const float* a, const float* b, int d) {
  double s = 0.0;
  for (int i = 0; i < d; ++i) s += double(a[i]) * b[i];
  return s;
}

}  // namespace

void attend_range_reference(kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                            std::int64_t begin, std::int64_t end, const BoundContext& ctx,
                            std::vector<HeadPartial>& partials) {
  const int d = head_dim;
  const BoundEvaluator bounds(reader, q, group, d, ctx);
  partials.resize(group);
  for (HeadPartial& p : partials) p.acc.resize(d, 0.0);
  std::vector<float> k(d), v(d);
  kvcache::KeyBound bound;
  for (std::int64_t t = begin; t < end; ++t) {
    reader.key(t, k.data(), bound);
    double rho = 0.0;
    reader.value(t, v.data(), rho);
    const double v_norm = std::sqrt(dot(v.data(), v.data(), d));
    for (int h = 0; h < group; ++h) {
      const double z = ctx.sm * dot(q + h * d, k.data(), d);
      HeadPartial& p = partials[h];
      if (bound.shared_dither)
        p.meter.add_moment(z, bounds.c(h, bound));
      else
        p.meter.add(z, bounds.c(h, bound));
      p.add(z, v.data(), d, rho, v_norm);
    }
  }
}

PageTerms page_contributions(kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                             std::int64_t begin, std::int64_t end, const BoundContext& ctx,
                             const std::vector<double>& lse_z) {
  const int d = head_dim;
  const std::int64_t page = reader.config().page_size;
  const BoundEvaluator bounds(reader, q, group, d, ctx);
  const std::vector<double> zeros((end + page - 1) / page, 0.0);
  PageTerms terms{std::vector<std::vector<double>>(group, zeros), std::vector<std::vector<double>>(group, zeros)};
  std::vector<float> k(d), v(d);
  kvcache::KeyBound bound;
  for (std::int64_t t = begin; t < end; ++t) {
    reader.key(t, k.data(), bound);
    double rho = 0.0;
    reader.value(t, v.data(), rho);
    for (int h = 0; h < group; ++h) {
      const double p_t = std::exp(ctx.sm * dot(q + h * d, k.data(), d) - lse_z[h]);
      terms.a[h][t / page] += p_t * std::expm1(bounds.c(h, bound));  // p̃_t (e^{c_t} − 1)
      terms.rho[h][t / page] += p_t * rho;
    }
  }
  return terms;
}

std::vector<double> retention_raw(kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                                  std::int64_t begin, std::int64_t end, const BoundContext& ctx) {
  const int d = head_dim;
  std::vector<HeadPartial> partials;
  attend_range_reference(reader, q, group, d, begin, end, ctx, partials);
  const BoundEvaluator bounds(reader, q, group, d, ctx);
  std::vector<std::vector<double>> z(group, std::vector<double>(end - begin)), c = z;
  std::vector<float> k(d);
  kvcache::KeyBound bound;
  for (std::int64_t t = begin; t < end; ++t) {
    reader.key(t, k.data(), bound);
    for (int h = 0; h < group; ++h) {
      z[h][t - begin] = ctx.sm * dot(q + h * d, k.data(), d);
      c[h][t - begin] = bounds.c(h, bound);
    }
  }
  std::vector<double> out(group);
  for (int h = 0; h < group; ++h) {
    const cert::MeterStats& m = partials[h].meter;
    // A rounded up and A⁻ rounded down (moment tokens included) only raise the form: it grows
    // with A and falls with A⁻ term by term.
    out[h] = cert::retention_raw(z[h], c[h], m.z.value(), m.log_A(), m.log_A_minus());
    if (std::isnan(out[h])) out[h] = INFINITY;
  }
  return out;
}

HeadResult finish(const HeadPartial& p, int head_dim, float* out, cert::BoundShape shape, double delta_v) {
  HeadResult r;
  for (int i = 0; i < head_dim; ++i) out[i] = static_cast<float>(p.acc[i] / p.l);
  const double log_A = p.meter.log_A(), log_A_minus = p.meter.log_A_minus();
  r.eform_raw = cert::eform_raw(log_A);
  cert::Bounds b;
  b.eform = b.retention = r.eform_raw;
  b.two_sided = cert::two_sided_raw(log_A, log_A_minus);
  b.tanh = cert::tanh_shape(p.meter.c_max);
  b.tanh_half = cert::tanh_half_shape(p.meter.c_max);
  r.meter = std::isnan(log_A) || std::isnan(p.m) ? 1.0 : b.meter(shape);
  // Float weights (the fast kernel) move the weighted mean of ρ^v_t by at most ε times the largest
  // ρ^v_t among their tokens (cert::float_weight_error).
  double weighted_rho = p.rho / p.l;
  if (p.meter.float_c_max >= 0.0) weighted_rho += cert::float_weight_error(p.meter.n) * p.float_rho_max;
  r.v_meter_sure = cert::value_meter(weighted_rho, p.v_max);
  if (delta_v > 0.0 && p.meter.float_c_max < 0.0)
    weighted_rho = std::min(weighted_rho, cert::value_tier_b(weighted_rho, p.rho2 / (p.l * p.l), head_dim, delta_v));
  r.v_meter = cert::value_meter(weighted_rho, p.v_max);
  r.output_bound = cert::value_output_bound(r.meter, p.v_max, weighted_rho);
  if (std::isnan(p.m) || !(p.l > 0.0)) {
    r.eform_raw = INFINITY;
    r.meter = 1.0;
    r.v_meter = r.v_meter_sure = INFINITY;
    r.output_bound = INFINITY;
  }
  return r;
}

TrueErrors true_errors(kvcache::KvStore::Reader& reader, const float* q, int head_dim, std::int64_t begin,
                       std::int64_t end) {
  if (!reader.has_exact_tier()) throw std::logic_error("the true TV reads the exact backing tier, and this cache keeps none");
  const int d = head_dim;
  const double sm = 1.0 / std::sqrt(static_cast<double>(d));
  const std::int64_t n = end - begin;
  std::vector<double> z(n), z_hat(n);
  std::vector<float> k(d), v(d), v_hat(d);
  kvcache::KeyBound bound;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = begin + i;
    double a = 0.0, b = 0.0;
    reader.exact_key(t, k.data());
    for (int i = 0; i < d; ++i) a += double(q[i]) * k[i];
    reader.key(t, k.data(), bound);
    for (int i = 0; i < d; ++i) b += double(q[i]) * k[i];
    z[i] = sm * a;
    z_hat[i] = sm * b;
  }
  const double mz = *std::max_element(z.begin(), z.end()), mh = *std::max_element(z_hat.begin(), z_hat.end());
  double sz = 0.0, sh = 0.0;
  for (std::int64_t t = 0; t < n; ++t) sz += std::exp(z[t] - mz), sh += std::exp(z_hat[t] - mh);
  TrueErrors e;
  std::vector<double> err(d, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const double p_hat = std::exp(z_hat[i] - mh) / sh;
    e.tv += std::fabs(std::exp(z[i] - mz) / sz - p_hat);
    double rho = 0.0;
    reader.value(begin + i, v_hat.data(), rho);
    reader.exact_value(begin + i, v.data());
    for (int c = 0; c < d; ++c) err[c] += p_hat * (double(v_hat[c]) - v[c]);
  }
  e.tv *= 0.5;
  double e2 = 0.0;
  for (const double x : err) e2 += x * x;
  e.value_error = std::sqrt(e2);
  return e;
}

double true_tv(kvcache::KvStore::Reader& reader, const float* q, int head_dim, std::int64_t begin, std::int64_t end) {
  return true_errors(reader, q, head_dim, begin, end).tv;
}

}  // namespace witcert::attention
