// Dithered codes of B < 8 bits packed without waste: code i of a run occupies bits [i·B, i·B + B)
// of the run's bytes, least significant first, as the offset-binary value code + 2^(B−1) (in
// [1, 2^B − 1], since |code| ≤ 2^(B−1) − 1). Two 4-bit codes share a byte; eight 5-bit or four
// 6-bit codes fill five or three bytes. The pool keeps one run per page and side (kvcache/).
#pragma once

#include <cstddef>
#include <cstdint>

namespace witcert::formats {

// Bytes that hold n codes of `bits` bits.
constexpr std::size_t packed_code_bytes(std::size_t n, int bits) { return (n * static_cast<std::size_t>(bits) + 7) / 8; }

// Writes code i of the run (its other bits unchanged).
void pack_code(std::uint8_t* run, std::size_t i, int bits, std::int8_t code);
// Reads code i of the run.
std::int8_t unpack_code(const std::uint8_t* run, std::size_t i, int bits);
// Codes [0, n) of the run into out, n a multiple of 8 (the fast kernel's page decode).
void unpack_codes(const std::uint8_t* run, int bits, std::size_t n, std::int8_t* out);

}  // namespace witcert::formats
