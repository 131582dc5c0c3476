#include "formats/dither/code_pack.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "formats/dither/dither.h"

namespace witcert::formats {
namespace {

TEST(CodePack, KnownBytes) {
  // 4 bits: u = code + 8; byte j holds u_j (low nibble) and u_{j+16} (high nibble).
  std::vector<std::uint8_t> four(16, 0);
  pack_code(four.data(), 0, 4, 1);    // u 9
  pack_code(four.data(), 16, 4, -7);  // u 1
  pack_code(four.data(), 15, 4, 7);   // u 15
  pack_code(four.data(), 31, 4, 0);   // u 8
  EXPECT_EQ(four[0], 0x19);
  EXPECT_EQ(four[15], 0x8F);
  for (int j = 1; j < 15; ++j) EXPECT_EQ(four[j], 0) << j;
  // 5 bits: u = code + 16; bit 4 of u_i is bit i/4 of byte 16 + i%4.
  std::vector<std::uint8_t> five(20, 0);
  pack_code(five.data(), 0, 5, 15);   // u 31: nibble 15, high bit in byte 16 bit 0
  pack_code(five.data(), 5, 5, -15);  // u 1
  pack_code(five.data(), 31, 5, 0);   // u 16: nibble 0, high bit in byte 19 bit 7
  EXPECT_EQ(five, (std::vector<std::uint8_t>{0x0F, 0, 0, 0, 0, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01, 0, 0, 0x80}));
  // 6 bits: u = code + 32; bits 4–5 of u_i are bits 2(i/8), 2(i/8)+1 of byte 16 + i%8.
  std::vector<std::uint8_t> six(24, 0);
  pack_code(six.data(), 9, 6, 31);    // u 63: nibble 15 in byte 9, high 3 in byte 17 at bit 2
  pack_code(six.data(), 30, 6, -31);  // u 1: nibble 1 in byte 14's high half
  pack_code(six.data(), 24, 6, 0);    // u 32: nibble 0, high 2 in byte 16 at bit 6
  std::vector<std::uint8_t> want6(24, 0);
  want6[9] = 0x0F, want6[14] = 0x10, want6[17] = 0x0C, want6[16] = 0x80;
  EXPECT_EQ(six, want6);
  EXPECT_EQ(packed_code_bytes(32, 4), 16u);
  EXPECT_EQ(packed_code_bytes(64, 5), 40u);
  EXPECT_EQ(packed_code_bytes(64 * 16, 6), 768u);
}

// Every code of every width, written in a random order over a random run: each read (one code,
// and the page decode against it) returns what was written last, and no write touches a neighbour.
TEST(CodePack, RandomWritesReadBackOneByOneAndAsAPage) {
  std::mt19937_64 rng(7);
  for (int bits : {4, 5, 6}) {
    const int q = dither_max_code(bits);
    for (std::size_t n : {32u, 64u, 1024u, 32u * 257u}) {
      std::vector<std::uint8_t> run(packed_code_bytes(n, bits));
      for (auto& b : run) b = static_cast<std::uint8_t>(rng());
      std::vector<std::int8_t> want(n);
      for (std::size_t i = 0; i < n; ++i) {
        want[i] = static_cast<std::int8_t>(std::uniform_int_distribution<int>(-q, q)(rng));
        pack_code(run.data(), i, bits, want[i]);
      }
      for (int k = 0; k < 3 * static_cast<int>(n); ++k) {  // rewrites in any order
        const std::size_t i = rng() % n;
        want[i] = static_cast<std::int8_t>(std::uniform_int_distribution<int>(-q, q)(rng));
        pack_code(run.data(), i, bits, want[i]);
      }
      std::vector<std::int8_t> page(n);
      unpack_codes(run.data(), bits, n, page.data());
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(unpack_code(run.data(), i, bits), want[i]) << bits << " bits, code " << i;
        ASSERT_EQ(page[i], want[i]) << bits << " bits, code " << i;
      }
    }
  }
}

TEST(CodePack, RefusesWhatItCannotDecode) {
  std::vector<std::uint8_t> run(32);
  std::vector<std::int8_t> out(32);
  EXPECT_THROW(unpack_codes(run.data(), 4, 16, out.data()), std::invalid_argument);
  EXPECT_THROW(unpack_codes(run.data(), 8, 32, out.data()), std::invalid_argument);
}

}  // namespace
}  // namespace witcert::formats
