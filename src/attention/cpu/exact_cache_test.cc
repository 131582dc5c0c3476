// The exact cache keeps its rows in pages of a pool: a copy owns its pages, clear() returns them,
// and a position can only follow the ones before it.
#include "attention/cpu/exact_cache.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "base/alloc_counter.h"

namespace witcert::attention {
namespace {

constexpr int kLayers = 2, kKvHeads = 2, kDim = 64, kGroup = 3;

void fill(ExactKvCache& c, std::int64_t from, std::int64_t to, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> k(kDim), v(kDim);
  for (std::int64_t p = from; p < to; ++p)
    for (int l = 0; l < kLayers; ++l)
      for (int h = 0; h < kKvHeads; ++h) {
        for (int i = 0; i < kDim; ++i) k[i] = g(rng), v[i] = g(rng);
        c.write(l, h, p, k.data(), v.data());
      }
}

std::vector<float> attend_all(ExactKvCache& c, std::int64_t n) {
  std::vector<float> q(kGroup * kDim, 0.3f), out(kGroup * kDim), all;
  for (int l = 0; l < kLayers; ++l)
    for (int h = 0; h < kKvHeads; ++h) {
      c.attend(l, h, q.data(), kGroup, n, out.data());
      all.insert(all.end(), out.begin(), out.end());
    }
  return all;
}

TEST(ExactCache, EveryPageSizeServesTheSameRows) {
  ExactKvCache base({kLayers, kKvHeads, kDim, 70}, 70);
  fill(base, 0, 70, 1);
  const std::vector<float> want = attend_all(base, 70);
  for (int page : {1, 7, 16, 64}) {
    ExactKvCache c({kLayers, kKvHeads, kDim, 70}, page);
    fill(c, 0, 70, 1);
    const std::vector<float> got = attend_all(c, 70);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << page;
    for (std::int64_t p : {0, 15, 16, 69})
      EXPECT_EQ(std::memcmp(c.key(1, 1, p), base.key(1, 1, p), kDim * sizeof(f16)), 0) << page << " " << p;
  }
}

TEST(ExactCache, ACopyOwnsItsPagesAndClearReturnsThem) {
  ExactKvCache a({kLayers, kKvHeads, kDim, 64}, 16);
  fill(a, 0, 40, 2);
  ExactKvCache b = a;
  const std::vector<float> before = attend_all(a, 40);
  fill(b, 40, 64, 3);  // the copy grows on its own pages
  EXPECT_EQ(attend_all(a, 40), before);
  EXPECT_EQ(attend_all(b, 40), before);
  b.clear();
  fill(b, 0, 64, 4);  // every page back in the pool: a new request fits
  EXPECT_NE(attend_all(b, 40), before);
  EXPECT_EQ(attend_all(a, 40), before);
}

TEST(ExactCache, RejectsPositionsItCannotHold) {
  ExactKvCache c({kLayers, kKvHeads, kDim, 40}, 16);
  std::vector<float> x(kDim, 1.0f);
  EXPECT_THROW(c.write(0, 0, 40, x.data(), x.data()), std::out_of_range);
  EXPECT_THROW(c.write(0, 0, -1, x.data(), x.data()), std::out_of_range);
  EXPECT_THROW(c.write(0, 0, 20, x.data(), x.data()), std::invalid_argument);  // does not follow position 0
  EXPECT_THROW(c.write(2, 0, 0, x.data(), x.data()), std::out_of_range);
  EXPECT_THROW(ExactKvCache({kLayers, kKvHeads, kDim, 40}, 0), std::invalid_argument);
  EXPECT_THROW(ExactKvCache({kLayers, kKvHeads, kDim, 0}, 16), std::invalid_argument);
}

// A plain attention call, one position's or a causal run's, allocates nothing once the calling
// thread's buffers have served a call as long.
TEST(ExactCache, AttentionAllocatesNothingOnceWarm) {
  const std::int64_t n = 70, run = 16;
  ExactKvCache c({kLayers, kKvHeads, kDim, n}, 16);
  fill(c, 0, n, 3);
  std::vector<float> q(run * kGroup * kDim, 0.25f), out(run * kGroup * kDim);
  c.attend(0, 0, q.data(), kGroup, n, out.data());  // warm-up
  c.attend_causal(0, 0, q.data(), kGroup * kDim, kGroup, n - run, run, 0, out.data(), kGroup * kDim);
  const long before = testing_util::thread_allocations();
  for (int l = 0; l < kLayers; ++l)
    for (int h = 0; h < kKvHeads; ++h) {
      for (const std::int64_t n_ctx : {std::int64_t{1}, std::int64_t{17}, n})
        c.attend(l, h, q.data(), kGroup, n_ctx, out.data());
      c.attend_causal(l, h, q.data(), kGroup * kDim, kGroup, n - run, run, 0, out.data(), kGroup * kDim);
      c.attend_causal(l, h, q.data(), kGroup * kDim, kGroup, 0, 5, 0, out.data(), kGroup * kDim);
    }
  EXPECT_EQ(testing_util::thread_allocations() - before, 0);
}

}  // namespace
}  // namespace witcert::attention
