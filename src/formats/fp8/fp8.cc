#include "formats/fp8/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace witcert::formats {

std::uint8_t fp8_e4m3_from_double(double v) {
  if (!std::isfinite(v)) return kFp8E4m3NaN;
  const std::uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(v);
  if (a >= kFp8E4m3Max) return sign | 0x7E;
  int e;
  std::frexp(a, &e);  // a ∈ [2^(e−1), 2^e)
  // The spacing of E4M3 values around a: 2^(e−4) for normals, 2^-9 for subnormals. Below 448
  // the rounded value is at most 448 (the spacing there is 32 and 448 = 14·32), so it fits.
  const int ulp_exp = std::max(e - 4, -9);
  const int units = static_cast<int>(std::nearbyint(std::ldexp(a, -ulp_exp)));  // ties to even
  if (units == 0) return sign;
  if (ulp_exp == -9 && units < 8) return sign | static_cast<std::uint8_t>(units);  // subnormal
  // units·2^ulp_exp with units ∈ [8, 16]: 16 means the rounding carried into the next binade.
  const int exponent = units == 16 ? ulp_exp + 4 : ulp_exp + 3;
  const int mantissa = units == 16 ? 0 : units - 8;
  return sign | static_cast<std::uint8_t>(((exponent + 7) << 3) | mantissa);
}

double fp8_e4m3_to_double(std::uint8_t b) {
  const int exponent = (b >> 3) & 0xF;
  const int mantissa = b & 0x7;
  double magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<double>(mantissa), -9);
  } else {
    magnitude = std::ldexp(static_cast<double>(8 + mantissa), exponent - 10);
  }
  return (b & 0x80) ? -magnitude : magnitude;
}

const float* fp8_e4m3_float_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(fp8_e4m3_to_double(static_cast<std::uint8_t>(b)));
    return t;
  }();
  return table.data();
}

}  // namespace witcert::formats
