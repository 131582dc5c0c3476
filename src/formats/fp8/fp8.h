// OCP 8-bit floating point E4M3FN, the format of "fp8" KV caches: 1 sign, 4 exponent (bias 7) and
// 3 mantissa bits, no infinities. S.1111.111 is NaN, so the largest finite value is 1.75·2^8 = 448;
// subnormals are m·2^-9 (m = 1..7).
#pragma once

#include <cstdint>

namespace witcert::formats {

inline constexpr std::uint8_t kFp8E4m3NaN = 0x7F;
inline constexpr double kFp8E4m3Max = 448.0;

// v rounded to nearest, ties to even; finite values beyond ±448 saturate to ±448 (the raw cast of
// fp8 KV caches). ±inf and NaN become NaN: E4M3FN has no infinity, and saturating one would turn a
// non-finite key into a finite wrong one.
std::uint8_t fp8_e4m3_from_double(double v);

// The exact value of an E4M3FN bit pattern (the reference decode).
double fp8_e4m3_to_double(std::uint8_t b);

// fp8_e4m3_to_double of every bit pattern as a float (each is exact in float): the decode table
// of the cache's read path, built once from the reference decode.
const float* fp8_e4m3_float_table();

}  // namespace witcert::formats
