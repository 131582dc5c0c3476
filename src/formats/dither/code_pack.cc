#include "formats/dither/code_pack.h"

#include <cstring>
#include <stdexcept>

namespace witcert::formats {
namespace {

// The bits [p, p + 16) of the run, reading only the bytes that hold [p, p + bits).
unsigned window(const std::uint8_t* run, std::size_t p, int bits) {
  const std::size_t byte = p / 8;
  unsigned w = run[byte];
  if (p % 8 + static_cast<std::size_t>(bits) > 8) w |= static_cast<unsigned>(run[byte + 1]) << 8;
  return w >> (p % 8);
}

// Eight codes from `bits` bytes: one 64-bit word, then shifts.
template <int B>
void unpack8(const std::uint8_t* run, std::size_t n, std::int8_t* out) {
  constexpr std::uint64_t kMask = (1u << B) - 1;
  constexpr int kOffset = 1 << (B - 1);
  for (std::size_t i = 0; i < n; i += 8, run += B) {
    std::uint64_t w = 0;
    std::memcpy(&w, run, B);  // little-endian hosts only (x86-64, AArch64)
    for (int j = 0; j < 8; ++j) out[i + j] = static_cast<std::int8_t>(static_cast<int>((w >> (B * j)) & kMask) - kOffset);
  }
}

}  // namespace

void pack_code(std::uint8_t* run, std::size_t i, int bits, std::int8_t code) {
  const std::size_t p = i * static_cast<std::size_t>(bits), byte = p / 8;
  const unsigned shift = static_cast<unsigned>(p % 8);
  const unsigned mask = ((1u << bits) - 1) << shift;
  const unsigned value = (static_cast<unsigned>(code + (1 << (bits - 1))) << shift) & mask;
  run[byte] = static_cast<std::uint8_t>((run[byte] & ~mask) | value);
  if (shift + static_cast<unsigned>(bits) > 8)
    run[byte + 1] = static_cast<std::uint8_t>((run[byte + 1] & ~(mask >> 8)) | (value >> 8));
}

std::int8_t unpack_code(const std::uint8_t* run, std::size_t i, int bits) {
  const unsigned u = window(run, i * static_cast<std::size_t>(bits), bits) & ((1u << bits) - 1);
  return static_cast<std::int8_t>(static_cast<int>(u) - (1 << (bits - 1)));
}

void unpack_codes(const std::uint8_t* run, int bits, std::size_t n, std::int8_t* out) {
  if (n % 8 != 0) throw std::invalid_argument("unpack_codes takes a multiple of 8 codes");
  switch (bits) {
    case 4: return unpack8<4>(run, n, out);
    case 5: return unpack8<5>(run, n, out);
    case 6: return unpack8<6>(run, n, out);
    default: throw std::invalid_argument("packed codes take 4, 5 or 6 bits");
  }
}

}  // namespace witcert::formats
