#include "formats/dither/dither.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "formats/dither/philox.h"

namespace witcert::formats {

void dither_values(const DitherStream& stream, std::uint32_t slot, std::span<float> xi) {
  const PhiloxKey key = {static_cast<std::uint32_t>(stream.seed),
                         static_cast<std::uint32_t>(stream.seed >> 32)};
  for (std::size_t c0 = 0; c0 < xi.size(); c0 += 4) {
    const PhiloxCounter words = philox4x32_10(
        {slot, static_cast<std::uint32_t>(c0 / 4), stream.kv_head, stream.layer}, key);
    for (std::size_t i = 0; i < 4 && c0 + i < xi.size(); ++i) xi[c0 + i] = dither_from_bits(words[i]);
  }
}

void check_group(int d, int group) {
  if (group <= 0 || d <= 0 || d % group != 0)
    throw std::invalid_argument("scale group " + std::to_string(group) +
                                " must divide the head dimension " + std::to_string(d));
}

namespace {

// The scale of n values x[i·stride] (rounded to fp16 first), those with skip[i·stride] set left
// out: amax/(Q − ½) rounded up to fp16, +inf when one of them is not finite.
f16 scale_of(int bits, const float* x, int n, std::size_t stride, const std::uint8_t* skip) {
  double amax = 0.0;
  for (int i = 0; i < n; ++i) {
    if (skip != nullptr && skip[i * stride]) continue;
    const double v = fp16_to_double(fp16_from_double(x[i * stride]));
    if (!std::isfinite(v)) return kFp16PosInf;
    amax = std::max(amax, std::fabs(v));
  }
  return fp16_from_double(amax / dither_scale_divisor(bits), Round::up);
}

}  // namespace

const char* scale_granularity_name(ScaleGranularity g) {
  return g == ScaleGranularity::channel ? "channel" : "token";
}

ScaleGranularity parse_scale_granularity(const std::string& name) {
  for (ScaleGranularity g : {ScaleGranularity::token, ScaleGranularity::channel})
    if (name == scale_granularity_name(g)) return g;
  throw std::invalid_argument("unknown scale granularity '" + name + "' (token or channel)");
}

void encode_dither(int bits, std::span<const float> x, std::span<const float> xi,
                        std::span<const std::uint8_t> outlier, int group, std::span<std::int8_t> codes,
                        std::span<f16> scales, std::span<f16> outlier_values) {
  const int d = static_cast<int>(x.size());
  for (int g0 = 0; g0 < d; g0 += group) scales[g0 / group] = scale_of(bits, &x[g0], group, 1, &outlier[g0]);
  encode_dither_scaled(x, xi, outlier, scales, group, codes, outlier_values);
}

void dither_channel_scales(int bits, std::span<const float> x, int n, std::span<const std::uint8_t> outlier,
                           std::span<f16> scales) {
  const std::size_t d = scales.size();
  for (std::size_t c = 0; c < d; ++c) scales[c] = outlier[c] ? f16{} : scale_of(bits, &x[c], n, d, nullptr);
}

// All arithmetic below is in double on fp16 inputs, fp16 scales and dither on a 2^-24 grid,
// where x/s + ξ is exact enough that round() picks a nearest integer: |x̂ − x| ≤ s/2 holds
// exactly, not just up to rounding (docs/tier-b.md).
void encode_dither_scaled(std::span<const float> x, std::span<const float> xi, std::span<const std::uint8_t> outlier,
                          std::span<const f16> scales, int group, std::span<std::int8_t> codes,
                          std::span<f16> outlier_values) {
  std::size_t n_out = 0;
  for (std::size_t c = 0; c < x.size(); ++c) {
    const f16 x16 = fp16_from_double(x[c]);
    if (outlier[c]) {
      codes[c] = 0;
      outlier_values[n_out++] = x16;
      continue;
    }
    const double s = fp16_to_double(scales[c / group]);
    if (!std::isfinite(s) || s == 0.0) {  // s = 0: every value it covers is zero and reconstructs exactly
      codes[c] = 0;
      continue;
    }
    const double code = std::nearbyint(fp16_to_double(x16) / s + static_cast<double>(xi[c]));
    codes[c] = static_cast<std::int8_t>(code);  // |code| ≤ Q because |x/s| ≤ Q − ½, |ξ| ≤ ½
  }
}

void decode_dither(std::span<const std::int8_t> codes, std::span<const f16> scales,
                        std::span<const float> xi, std::span<const std::uint8_t> outlier,
                        std::span<const f16> outlier_values, int group, std::span<float> out) {
  std::size_t n_out = 0;
  for (std::size_t c = 0; c < codes.size(); ++c) {
    if (outlier[c]) {
      out[c] = fp16_to_float(outlier_values[n_out++]);
      continue;
    }
    const double s = fp16_to_double(scales[c / group]);
    out[c] = static_cast<float>(s * (static_cast<double>(codes[c]) - static_cast<double>(xi[c])));
  }
}

}  // namespace witcert::formats
