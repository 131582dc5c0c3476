#include "formats/rotation/hadamard.h"

#include <cmath>

#include "formats/dither/philox.h"

namespace witcert::formats {

namespace {
constexpr PhiloxKey kRotationKey = {0x726F7434u, 0x68616461u};  // "rot4", "hada"
}  // namespace

void fwht_orthonormal(std::span<double> x) {
  const std::size_t n = x.size();
  for (std::size_t h = 1; h < n; h *= 2) {
    for (std::size_t i = 0; i < n; i += 2 * h) {
      for (std::size_t j = i; j < i + h; ++j) {
        const double a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const double norm = 1.0 / std::sqrt(static_cast<double>(n));
  for (double& v : x) v *= norm;
}

double rotation_sign(int c) {
  const auto u = static_cast<std::uint32_t>(c);
  const PhiloxCounter words = philox4x32_10({u / 128, 0, 0, 0}, kRotationKey);
  return (words[(u / 32) % 4] >> (u % 32)) & 1u ? -1.0 : 1.0;
}

void rotate(std::span<double> x) {
  for (std::size_t c = 0; c < x.size(); ++c) x[c] *= rotation_sign(static_cast<int>(c));
  fwht_orthonormal(x);
}

void unrotate(std::span<double> y) {
  fwht_orthonormal(y);
  for (std::size_t c = 0; c < y.size(); ++c) y[c] *= rotation_sign(static_cast<int>(c));
}

}  // namespace witcert::formats
