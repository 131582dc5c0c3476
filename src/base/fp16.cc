#include "base/fp16.h"

#include <cmath>
#include <cstring>

namespace witcert {

double fp16_to_double(f16 h) {
  const std::uint64_t sign = static_cast<std::uint64_t>(h & 0x8000) << 48;
  const int exponent = (h >> 10) & 0x1F;
  const std::uint64_t mantissa = h & 0x3FF;
  if (exponent == 31) return mantissa == 0 ? (sign ? -INFINITY : INFINITY) : (sign ? -NAN : NAN);
  double v;
  if (exponent == 0) {
    v = static_cast<double>(mantissa) * 0x1p-24;  // subnormal or zero, exact
    return sign ? -v : v;
  }
  // Normal: the same significand bits under the double's exponent bias.
  const std::uint64_t bits = sign | (static_cast<std::uint64_t>(exponent - 15 + 1023) << 52) | (mantissa << 42);
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

f16 fp16_next_up(f16 h) {
  if ((h & 0x7C00) == 0x7C00) {
    if ((h & 0x3FF) != 0 || h == kFp16PosInf) return h;  // NaN or +inf
    return 0xFBFF;                                         // -inf -> lowest finite
  }
  if (h == 0x8000) return 0x0001;  // -0 -> smallest positive subnormal
  if (h & 0x8000) return static_cast<f16>(h - 1);
  return static_cast<f16>(h + 1);
}

namespace {

// Round-to-nearest-even conversion of a finite or infinite double.
f16 nearest(double v) {
  const f16 sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (std::isinf(a)) return sign | kFp16PosInf;
  // Values from 65520 up round to infinity under round-to-nearest-even.
  if (a >= 65520.0) return sign | kFp16PosInf;
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  // The spacing of fp16 values around a: 2^(e-11) for normals, 2^-24 for subnormals.
  const int ulp_exp = e - 11 < -24 ? -24 : e - 11;
  const double units = std::nearbyint(std::ldexp(a, -ulp_exp));  // ties to even
  const double r = std::ldexp(units, ulp_exp);
  if (r == 0.0) return sign;
  int re;
  std::frexp(r, &re);
  if (re - 1 < -14) {  // subnormal: value = mantissa * 2^-24
    return sign | static_cast<f16>(static_cast<int>(std::ldexp(r, 24)));
  }
  const int biased = re - 1 + 15;
  const int mantissa = static_cast<int>(std::ldexp(r, -(re - 1) + 10)) - 0x400;
  return sign | static_cast<f16>((biased << 10) | mantissa);
}

}  // namespace

f16 fp16_from_double_reference(double v, Round mode) {
  if (std::isnan(v)) return 0x7E00;
  f16 h = nearest(v);
  if (mode == Round::up && fp16_to_double(h) < v) h = fp16_next_up(h);
  return h;
}

f16 fp16_from_double(double v, Round mode) {
  if (std::isnan(v)) return 0x7E00;
  // A double that is a float (every value a cache writes) takes the bit-manipulation path, which
  // rounds the same value the same way; fp16_to_float is exact.
  const float f = static_cast<float>(v);
  if (static_cast<double>(f) != v) return fp16_from_double_reference(v, mode);
  f16 h = fp16_from_float(f);
  if (mode == Round::up && static_cast<double>(fp16_to_float(h)) < v) h = fp16_next_up(h);
  return h;
}

}  // namespace witcert
