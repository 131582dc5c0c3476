#include "formats/dither/code_pack.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "formats/dither/dither.h"

namespace witcert::formats {
namespace {

TEST(CodePack, KnownBytes) {
  // 4 bits: code + 8 in each nibble, the first code low.
  std::vector<std::uint8_t> run(4, 0);
  const std::int8_t four[] = {1, -1, 7, -7, 0, 3, -3, 2};
  for (std::size_t i = 0; i < 8; ++i) pack_code(run.data(), i, 4, four[i]);
  EXPECT_EQ(run, (std::vector<std::uint8_t>{0x79, 0x1F, 0xB8, 0xA5}));
  // 5 bits: 16 + code, bits [5i, 5i + 5): codes 15, −15, 0 → 31, 1, 16 → 0b10000'00001'11111.
  std::vector<std::uint8_t> five(2, 0);
  const std::int8_t c5[] = {15, -15, 0};
  for (std::size_t i = 0; i < 3; ++i) pack_code(five.data(), i, 5, c5[i]);
  EXPECT_EQ(five, (std::vector<std::uint8_t>{0x3F, 0x40}));
  // 6 bits: 32 + code: codes −31, 31, 0, 1 → 1, 63, 32, 33 → 100001'100000'111111'000001.
  std::vector<std::uint8_t> six(3, 0);
  const std::int8_t c6[] = {-31, 31, 0, 1};
  for (std::size_t i = 0; i < 4; ++i) pack_code(six.data(), i, 6, c6[i]);
  EXPECT_EQ(six, (std::vector<std::uint8_t>{0xC1, 0x0F, 0x86}));
  EXPECT_EQ(packed_code_bytes(8, 5), 5u);
  EXPECT_EQ(packed_code_bytes(3, 5), 2u);
  EXPECT_EQ(packed_code_bytes(64 * 16, 6), 768u);
}

// Every code of every width, written in a random order over a random run: each read (one code,
// and the page decode against it) returns what was written last, and no write touches a neighbour.
TEST(CodePack, RandomWritesReadBackOneByOneAndAsAPage) {
  std::mt19937_64 rng(7);
  for (int bits : {4, 5, 6}) {
    const int q = dither_max_code(bits);
    for (std::size_t n : {8u, 16u, 64u, 1024u, 8u * 257u}) {
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
  std::vector<std::uint8_t> run(8);
  std::vector<std::int8_t> out(8);
  EXPECT_THROW(unpack_codes(run.data(), 4, 7, out.data()), std::invalid_argument);
  EXPECT_THROW(unpack_codes(run.data(), 8, 8, out.data()), std::invalid_argument);
}

}  // namespace
}  // namespace witcert::formats
