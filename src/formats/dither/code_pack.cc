#include "formats/dither/code_pack.h"

#include <stdexcept>

namespace witcert::formats {
namespace {

// Where the high bits (above the nibble) of code r of a block sit: byte and shift.
struct High {
  std::size_t byte;
  unsigned shift, mask;
};
High high_bits(std::size_t r, int bits) {
  if (bits == 5) return {16 + r % 4, static_cast<unsigned>(r / 4), 1u};
  return {16 + r % 8, static_cast<unsigned>(2 * (r / 8)), 3u};  // bits == 6
}

}  // namespace

void pack_code(std::uint8_t* run, std::size_t i, int bits, std::int8_t code) {
  std::uint8_t* block = run + i / kCodeBlock * 4 * static_cast<std::size_t>(bits);
  const std::size_t r = i % kCodeBlock;
  const unsigned u = static_cast<unsigned>(code + (1 << (bits - 1)));
  const unsigned nibble_shift = r < 16 ? 0 : 4;
  std::uint8_t& lo = block[r % 16];
  lo = static_cast<std::uint8_t>((lo & ~(15u << nibble_shift)) | ((u & 15u) << nibble_shift));
  if (bits == 4) return;
  const High h = high_bits(r, bits);
  block[h.byte] = static_cast<std::uint8_t>((block[h.byte] & ~(h.mask << h.shift)) | (((u >> 4) & h.mask) << h.shift));
}

std::int8_t unpack_code(const std::uint8_t* run, std::size_t i, int bits) {
  const std::uint8_t* block = run + i / kCodeBlock * 4 * static_cast<std::size_t>(bits);
  const std::size_t r = i % kCodeBlock;
  unsigned u = (block[r % 16] >> (r < 16 ? 0 : 4)) & 15u;
  if (bits > 4) {
    const High h = high_bits(r, bits);
    u |= ((block[h.byte] >> h.shift) & h.mask) << 4;
  }
  return static_cast<std::int8_t>(static_cast<int>(u) - (1 << (bits - 1)));
}

void unpack_codes(const std::uint8_t* run, int bits, std::size_t n, std::int8_t* out) {
  if (n % kCodeBlock != 0) throw std::invalid_argument("unpack_codes takes whole blocks of 32 codes");
  if (bits < 4 || bits > 6) throw std::invalid_argument("packed codes take 4, 5 or 6 bits");
  for (std::size_t i = 0; i < n; ++i) out[i] = unpack_code(run, i, bits);
}

}  // namespace witcert::formats
