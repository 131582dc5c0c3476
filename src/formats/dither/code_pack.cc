#include "formats/dither/code_pack.h"

#include <cstring>
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

// One block of 32 codes in 64-bit words, eight codes a word: the nibbles by masks, the high bits
// of eight codes by one shift and mask of the high plane, and the offset taken per byte without
// borrows (u | 0x80 − 2^(B−1) stays in its byte; xor 0x80 gives u − 2^(B−1) in two's complement).
template <int B>
void unpack_block(const std::uint8_t* in, std::int8_t* out) {
  constexpr std::uint64_t kNibbles = 0x0F0F0F0F0F0F0F0FULL, kOnes = 0x0101010101010101ULL, kTop = 0x80 * kOnes;
  std::uint64_t nib[2], u[4];
  std::memcpy(nib, in, 16);
  u[0] = nib[0] & kNibbles, u[1] = nib[1] & kNibbles;                // codes 0–7, 8–15
  u[2] = (nib[0] >> 4) & kNibbles, u[3] = (nib[1] >> 4) & kNibbles;  // codes 16–23, 24–31
  if constexpr (B == 5) {  // bit k of byte j (j < 4) is code j + 4k's: codes 8w..8w+7 are k = 2w, 2w + 1
    std::uint32_t plane;
    std::memcpy(&plane, in + 16, 4);
    for (int w = 0; w < 4; ++w) {
      const std::uint64_t even = (plane >> (2 * w)) & 0x01010101u, odd = (plane >> (2 * w + 1)) & 0x01010101u;
      u[w] |= (even | (odd << 32)) << 4;
    }
  }
  if constexpr (B == 6) {  // bits 2k, 2k + 1 of byte j (j < 8) are code j + 8k's
    std::uint64_t plane;
    std::memcpy(&plane, in + 16, 8);
    for (int k = 0; k < 4; ++k) u[k] |= ((plane >> (2 * k)) & 0x0303030303030303ULL) << 4;
  }
  for (int w = 0; w < 4; ++w) {
    const std::uint64_t code = ((u[w] | kTop) - (1u << (B - 1)) * kOnes) ^ kTop;
    std::memcpy(out + 8 * w, &code, 8);  // little-endian hosts: byte j of word w is code 8w + j
  }
}

template <int B>
void unpack_run(const std::uint8_t* run, std::size_t n, std::int8_t* out) {
  for (std::size_t i = 0; i < n; i += kCodeBlock, run += 4 * B, out += kCodeBlock) unpack_block<B>(run, out);
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
  switch (bits) {
    case 4: return unpack_run<4>(run, n, out);
    case 5: return unpack_run<5>(run, n, out);
    case 6: return unpack_run<6>(run, n, out);
    default: throw std::invalid_argument("packed codes take 4, 5 or 6 bits");
  }
}

}  // namespace witcert::formats
