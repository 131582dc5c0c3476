// What host and device code share: WITCERT_HD marks a function that nvcc compiles for both, and is
// empty for the host compiler, so that the per-tile math of the CUDA kernel is the same source the
// host tests run against the CPU code (docs/cuda.md).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define WITCERT_HD __host__ __device__ inline
#else
#define WITCERT_HD inline
#endif

namespace witcert::cuda {

inline constexpr double kInf = HUGE_VAL;
inline constexpr double kRoundUpMargin = 1.0 + 0x1p-40;  // cert::kRoundUpMargin

// Classification without <cmath>'s macros, which differ between the host library and CUDA.
WITCERT_HD bool is_nan(double x) { return x != x; }
WITCERT_HD bool is_finite(double x) { return x - x == 0.0; }
WITCERT_HD double max_of(double a, double b) { return a < b ? b : a; }

WITCERT_HD float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The exact value of fp16 bits, as base/fp16.h's fp16_to_float computes it.
WITCERT_HD float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t em = h & 0x7FFFu;
  if (em >= 0x7C00u) return bits_to_float(sign | 0x7F800000u | ((em & 0x3FFu) << 13));
  if (em >= 0x0400u) return bits_to_float(sign | ((em + ((127u - 15u) << 10)) << 13));
  const float f = static_cast<float>(em) * 0x1p-24f;  // subnormal or zero, exact
  return sign ? -f : f;
}

WITCERT_HD double half_to_double(std::uint16_t h) { return static_cast<double>(half_to_float(h)); }

}  // namespace witcert::cuda
