// The bound shapes' arithmetic (Theorem 1's e-form, Proposition 1's two-sided form, tanh(c_max),
// tanh(c_max/2)) and how a set of them reads as a meter, written once for the host and the GPU:
// cert/meter.cc's eform_raw, two_sided_raw, tanh_shape, tanh_half_shape, clamp_meter and
// Bounds::meter are these functions, and the CUDA kernel's attention/cuda/meter_stats.h calls them
// from device code (nvcc compiles them __host__ __device__). Plain arithmetic and the C library's
// double functions only, no <cmath> classification macros (they differ between the host library
// and CUDA), so both compilers read the same source; the host results are bit for bit the CPU
// meter's because they are the same calls.
#pragma once

#include <math.h>

#include "cert/round_up.h"

#if defined(__CUDACC__)
#define WITCERT_CERT_HD __host__ __device__ inline
#else
#define WITCERT_CERT_HD inline
#endif

namespace witcert::cert::hd {

inline constexpr double kInf = HUGE_VAL;

// Below this a result nears the subnormal range, where the relative margin kRoundUpMargin no longer
// raises it past its roundings (it is less than one ulp there): the shapes take a first-order bound.
inline constexpr double kTiny = 0x1p-1000;

WITCERT_CERT_HD bool is_nan(double x) { return x != x; }

// A bound that came out NaN carries no information: report it as "no guarantee".
WITCERT_CERT_HD double sound(double v) { return is_nan(v) ? kInf : v; }

// Theorem 1: TV ≤ ½(A² − 1) = ½·expm1(2 log A), unclamped.
WITCERT_CERT_HD double eform_raw(double log_A) {
  if (is_nan(log_A)) return kInf;
  // Near the subnormal range a relative margin rounds away; there ½(e^{2y} − 1) = y + y² + ⅔y³ + …
  // ≤ y + 2y² < y + ulp(y) (2y² < 2^-53·y), so the next double above y bounds it (y = 0 is exact).
  if (log_A < kTiny) return log_A > 0.0 ? ::nextafter(log_A, kInf) : log_A;
  const double x = 2.0 * log_A;
  // expm1 keeps full precision for small A − 1; above, ½e^x − ½ avoids overflowing before the
  // halving (x − ln 2). Both are within an ulp or two, covered by the round-up margin.
  if (x < 1.0) return 0.5 * ::expm1(x) * kRoundUpMargin;
  return (::exp(x - 0.693147180559945309417232121458176568) - 0.5) * kRoundUpMargin;
}

// Proposition 1: TV ≤ ½(A/A⁻ − A⁻/A) = sinh(log A − log A⁻).
WITCERT_CERT_HD double two_sided_raw(double log_A, double log_A_minus) {
  // x = log A − log A⁻ sums two nonnegative terms, so it rounds by at most half an ulp. Near the
  // subnormal range sinh(x) = x + x³/6 + … lies within that half ulp of x, so the next double above
  // the rounded x bounds it where a relative margin would round away (x = 0 is exact).
  const double x = log_A - log_A_minus;
  if (x < kTiny) return x > 0.0 ? ::nextafter(x, kInf) : x;
  return sound(::sinh(x) * kRoundUpMargin);
}

// tanh(x) ≤ x for x ≥ 0: near the subnormal range, where tanh(c_max/2) would round to zero or
// below its value under any relative margin, x itself is the bound (c_max/2 rounded up).
WITCERT_CERT_HD double tanh_shape(double c_max) {
  if (is_nan(c_max)) return kInf;
  return c_max < kTiny ? c_max : ::tanh(c_max) * kRoundUpMargin;
}
WITCERT_CERT_HD double tanh_half_shape(double c_max) {
  if (is_nan(c_max)) return kInf;
  if (c_max < kTiny) {
    const double half = 0.5 * c_max;  // exact unless c_max is subnormal with its last bit set
    return half + half < c_max ? ::nextafter(half, kInf) : half;
  }
  return ::tanh(0.5 * c_max) * kRoundUpMargin;
}

// A sound bound as a meter: min(1, raw), always in [0, 1]; NaN or a negative value (not a bound)
// reads as no guarantee (1).
WITCERT_CERT_HD double clamp_meter(double raw) { return raw >= 0.0 ? (raw < 1.0 ? raw : 1.0) : 1.0; }

// The meter of n sound bounds: the first smallest, clamped to 1; any NaN or negative one makes the
// set no guarantee (1).
WITCERT_CERT_HD double min_meter(const double* forms, int n) {
  double lowest = kInf;
  for (int i = 0; i < n; ++i) {
    if (!(forms[i] >= 0.0)) return 1.0;
    lowest = forms[i] < lowest ? forms[i] : lowest;
  }
  return clamp_meter(lowest);
}

}  // namespace witcert::cert::hd
