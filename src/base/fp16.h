// IEEE 754 binary16 ("fp16") conversions with an explicit rounding direction.
//
// Layer 0: plain numeric types used by every layer above it. The certificate needs fp16
// values rounded *up* (a stored witness or scale must never be below the quantity it bounds),
// which the hardware conversions do not offer, so the conversions are written out here.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace witcert {

using f16 = std::uint16_t;  // raw binary16 bits

enum class Round { nearest_even, up };

// The exact value of an fp16 bit pattern (every fp16 value is representable in double).
double fp16_to_double(f16 h);

// The same as a float, by bit manipulation: the hot path of every fp16 cache read.
inline float fp16_to_float(f16 h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t em = h & 0x7FFFu;
  float f;
  if (em >= 0x7C00u) {  // inf, NaN
    const std::uint32_t bits = sign | 0x7F800000u | ((em & 0x3FFu) << 13);
    std::memcpy(&f, &bits, 4);
  } else if (em >= 0x0400u) {  // normal: rebias the exponent from 15 to 127
    const std::uint32_t bits = sign | ((em + ((127u - 15u) << 10)) << 13);
    std::memcpy(&f, &bits, 4);
  } else {  // subnormal or zero: em · 2^-24, exact in float
    f = static_cast<float>(em) * 0x1p-24f;
    if (sign) f = -f;
  }
  return f;
}

// Round-to-nearest-even float → fp16 by bit manipulation (the write path of an fp16 cache).
inline f16 fp16_from_float(float value) {
  std::uint32_t x;
  std::memcpy(&x, &value, 4);
  const f16 sign = static_cast<f16>((x >> 16) & 0x8000u);
  std::uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return sign | (ax > 0x7F800000u ? 0x7E00 : 0x7C00);
  if (ax >= 0x477FF000u) return sign | 0x7C00;  // ≥ 65520 rounds to infinity
  if (ax < 0x38800000u) {                        // below 2^-14: subnormal result
    float a;
    std::memcpy(&a, &ax, 4);
    return sign | static_cast<f16>(std::nearbyint(a * 0x1p24f));  // exact scaling, ties to even
  }
  ax += 0xFFFu + ((ax >> 13) & 1u);  // round the 13 dropped mantissa bits to nearest even
  return sign | static_cast<f16>((ax - (112u << 23)) >> 13);
}

// v rounded to fp16 in the given direction. Round::up returns the least fp16 value >= v
// (+inf when v exceeds the largest finite fp16, 65504). NaN maps to a quiet NaN.
f16 fp16_from_double(double v, Round mode = Round::nearest_even);
// The same conversion written out in double arithmetic for every input (fp16_from_double takes
// fp16_from_float for doubles that are floats): the tests' oracle.
f16 fp16_from_double_reference(double v, Round mode = Round::nearest_even);

// The next fp16 value towards +inf (identity on +inf and NaN).
f16 fp16_next_up(f16 h);

inline constexpr f16 kFp16PosInf = 0x7C00;
inline constexpr double kFp16Max = 65504.0;

}  // namespace witcert
