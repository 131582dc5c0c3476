// Dithered codes of B < 8 bits packed without waste, in blocks of 32 codes of 4·B bytes, laid out
// so that a block unpacks with shifts and masks alone (no bit-stream walking, no shuffles). Code i
// is stored as the offset-binary u_i = code + 2^(B−1) (in [1, 2^B − 1], since |code| ≤ 2^(B−1) − 1):
//   bytes [0, 16):  low nibbles; byte j holds u_j & 15 (low half) and u_{j+16} & 15 (high half);
//   B = 5, bytes [16, 20): bit k of byte j is bit 4 of u_{j+4k};
//   B = 6, bytes [16, 24): bits 2k, 2k+1 of byte j are bits 4, 5 of u_{j+8k}.
// The pool keeps one run per page and side (kvcache/); a run's codes are whole blocks.
#pragma once

#include <cstddef>
#include <cstdint>

namespace witcert::formats {

inline constexpr std::size_t kCodeBlock = 32;  // codes per packed block

// Bytes that hold n codes of `bits` bits (n a multiple of kCodeBlock).
constexpr std::size_t packed_code_bytes(std::size_t n, int bits) { return n / kCodeBlock * 4 * static_cast<std::size_t>(bits); }

// Writes code i of the run (its other codes unchanged).
void pack_code(std::uint8_t* run, std::size_t i, int bits, std::int8_t code);
// Reads code i of the run.
std::int8_t unpack_code(const std::uint8_t* run, std::size_t i, int bits);
// Codes [0, n) of the run into out, n a multiple of kCodeBlock, one unpack_code each: the scalar
// reference of the kernel's SIMD unpacking (attention/cpu/codes-inl.h).
void unpack_codes(const std::uint8_t* run, int bits, std::size_t n, std::int8_t* out);

}  // namespace witcert::formats
