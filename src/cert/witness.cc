#include "cert/witness.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace witcert::cert {

RopePair rope_pair(RopeLayout layout, int d, int j) {
  if (layout == RopeLayout::interleaved) return {2 * j, 2 * j + 1};
  return {j, j + d / 2};
}

BandLayout::BandLayout(int d_, int bands_, RopeLayout layout_) : d(d_), bands(bands_), layout(layout_) {
  if (d <= 0 || d % 2 != 0)
    throw std::invalid_argument("head dimension must be positive and even, got " + std::to_string(d));
  if (bands <= 0 || (d / 2) % bands != 0)
    throw std::invalid_argument("band count " + std::to_string(bands) +
                                " must divide the number of RoPE pairs " + std::to_string(d / 2));
}

int BandLayout::coordinate(int b, int i) const {
  const RopePair pair = rope_pair(layout, d, b * pairs_per_band() + i / 2);
  return i % 2 == 0 ? pair.lo : pair.hi;
}

namespace {

template <class Value>
double band_norm(const BandLayout& bl, int b, Value value) {
  double sum = 0.0;
  for (int i = 0; i < 2 * bl.pairs_per_band(); ++i) {
    const double x = value(bl.coordinate(b, i));
    sum += x * x;
  }
  return std::sqrt(sum) * kRoundUpMargin;
}

}  // namespace

void tier_a_witness(const BandLayout& bl, std::span<const float> k_hat, std::span<const float> k,
                    std::span<f16> w) {
  for (int b = 0; b < bl.bands; ++b) {
    const double norm = band_norm(bl, b, [&](int c) {
      return static_cast<double>(k_hat[c]) - static_cast<double>(k[c]);
    });
    w[b] = fp16_from_double(norm, Round::up);  // NaN residual -> NaN witness -> no guarantee
  }
}

void band_norms(const BandLayout& bl, std::span<const float> q, std::span<double> q_norm) {
  for (int b = 0; b < bl.bands; ++b)
    q_norm[b] = band_norm(bl, b, [&](int c) { return static_cast<double>(q[c]); });
}

double tier_a_c(std::span<const double> q_norm, std::span<const f16> w, double sm) {
  double sum = 0.0;
  for (std::size_t b = 0; b < w.size(); ++b) {
    if (q_norm[b] == 0.0) continue;  // |q_b · r_b| = 0 exactly
    sum += q_norm[b] * fp16_to_double(w[b]);
  }
  const double c = sm * sum * kRoundUpMargin;
  return std::isnan(c) ? INFINITY : c;
}

}  // namespace witcert::cert
