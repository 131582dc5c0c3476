#include "cert/subgaussian.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "cert/round_up.h"

namespace witcert::cert {

double delta_loc(double delta_req, long layers, long q_heads, long steps) {
  if (!(delta_req > 0.0 && delta_req < 1.0))
    throw std::invalid_argument("delta must lie in (0, 1), got " + std::to_string(delta_req));
  if (layers < 1 || q_heads < 1 || steps < 1)
    throw std::invalid_argument("layers, heads and decode budget must be at least 1");
  return delta_req / (static_cast<double>(layers) * static_cast<double>(q_heads) *
                      static_cast<double>(steps));
}

double dither_variance_proxy(std::span<const float> q, std::span<const f16> scales,
                             std::span<const std::uint8_t> outlier, int group, double sm) {
  double sum = 0.0;
  for (std::size_t c = 0; c < q.size(); ++c) {
    if (outlier[c]) continue;
    const double qc = q[c];
    if (qc == 0.0) continue;
    const double s = fp16_to_double(scales[c / group]);
    sum += qc * qc * s * s;
  }
  const double v = sm * sm / 12.0 * sum * kRoundUpMargin;
  return std::isnan(v) ? INFINITY : v;
}

double subgaussian_radius(double varsigma2, long S, double delta_loc, int non_outlier_channels) {
  const double varsigma = std::sqrt(varsigma2);
  // log(2S) − log δ_loc rather than log(2S/δ_loc): the quotient overflows for a tiny δ_loc.
  const double tail = std::sqrt(2.0 * (std::log(2.0 * static_cast<double>(S)) - std::log(delta_loc)));
  const double bias = 0x1p-17 * std::sqrt(12.0 * non_outlier_channels);
  const double u = varsigma * (tail + bias) * kRoundUpMargin;
  return std::isnan(u) ? INFINITY : u;
}

}  // namespace witcert::cert
