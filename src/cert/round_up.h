#pragma once

#include <cmath>

namespace witcert::cert {

// The relative margin by which computed norms, sums and radii are raised so that double
// rounding (a few units of 2^-53 per operation, over at most a few thousand operations) can
// never leave a computed bound below the exact one. It changes no reported digit that matters:
// 2^-40 ≈ 9e-13.
inline constexpr double kRoundUpMargin = 1.0 + 0x1p-40;

// The least float ≥ x (+inf above the float range; NaN stays NaN).
inline float float_round_up(double x) {
  const float f = static_cast<float>(x);
  return f < x ? std::nextafter(f, HUGE_VALF) : f;
}

}  // namespace witcert::cert
