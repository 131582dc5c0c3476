#include "formats/dither/philox.h"

#include <gtest/gtest.h>

#include <set>

#include "formats/dither/dither.h"

namespace witcert::formats {
namespace {

// Random123's kat_vectors for philox4x32 with 10 rounds.
TEST(Philox, Random123KnownAnswers) {
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (PhiloxCounter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (PhiloxCounter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (PhiloxCounter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
  static_assert(philox4x32_10({0, 0, 0, 0}, {0, 0})[0] == 0x6627e8d5, "usable at compile time");
}

TEST(Philox, DitherGridAndRange) {
  EXPECT_EQ(dither_from_bits(0), -0.5f);
  EXPECT_EQ(dither_from_bits(0xFFFFFFFFu), 0.5f - 0x1p-24f);
  EXPECT_EQ(dither_from_bits(0x80000000u), 0.0f);
  EXPECT_EQ(dither_from_bits(0x000000FFu), -0.5f);  // the low 8 bits are dropped
}

TEST(Philox, StreamsAreDistinctAndReproducible) {
  // Five-tuple uniqueness: changing any of seed, layer, kv_head, slot or channel changes ξ.
  std::vector<float> base(64), again(64), other(64);
  const DitherStream s{42, 3, 1};
  dither_values(s, 7, base);
  dither_values(s, 7, again);
  EXPECT_EQ(base, again);
  for (const auto& [stream, slot] : {std::pair{DitherStream{43, 3, 1}, 7u}, std::pair{DitherStream{42, 4, 1}, 7u},
                                    std::pair{DitherStream{42, 3, 2}, 7u}, std::pair{DitherStream{42, 3, 1}, 8u},
                                    std::pair{DitherStream{42ull | (1ull << 40), 3, 1}, 7u}}) {
    dither_values(stream, slot, other);
    int equal = 0;
    for (int c = 0; c < 64; ++c) equal += other[c] == base[c];
    EXPECT_LT(equal, 3);
  }
  std::set<float> channels(base.begin(), base.end());
  EXPECT_GT(channels.size(), 60u);  // channels within one slot are not repeated
}

}  // namespace
}  // namespace witcert::formats
