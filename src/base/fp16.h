// IEEE 754 binary16 ("fp16") conversions with an explicit rounding direction.
//
// Layer 0: plain numeric types used by every layer above it. The certificate needs fp16
// values rounded *up* (a stored witness or scale must never be below the quantity it bounds),
// which the hardware conversions do not offer, so the conversions are written out here.
#pragma once

#include <cstdint>

namespace witcert {

using f16 = std::uint16_t;  // raw binary16 bits

enum class Round { nearest_even, up };

// The exact value of an fp16 bit pattern (every fp16 value is representable in double).
double fp16_to_double(f16 h);
inline float fp16_to_float(f16 h) { return static_cast<float>(fp16_to_double(h)); }

// v rounded to fp16 in the given direction. Round::up returns the least fp16 value >= v
// (+inf when v exceeds the largest finite fp16, 65504). NaN maps to a quiet NaN.
f16 fp16_from_double(double v, Round mode = Round::nearest_even);

// The next fp16 value towards +inf (identity on +inf and NaN).
f16 fp16_next_up(f16 h);

inline constexpr f16 kFp16PosInf = 0x7C00;
inline constexpr double kFp16Max = 65504.0;

}  // namespace witcert
