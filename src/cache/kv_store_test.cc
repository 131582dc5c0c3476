// The store as a pool plus one sequence's state: a cleared sequence returns every page, and a page
// written again serves only what its new sequence wrote, for every format.
#include "cache/kv_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cache/test_config.h"
#include "quant/kv_format.h"

namespace witcert::cache {
namespace {

constexpr int kDim = 64;

void write_all(KvStore& s, std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> k(kDim), v(kDim);
  for (std::int64_t p = 0; p < n; ++p)
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < kDim; ++i) k[i] = g(rng), v[i] = g(rng);
      s.write(0, h, p, k.data(), v.data());
    }
}

// Every decoded key and value of stream (0, 1), with each key's bound kind. A dither-int8 key
// depends on its slot's dither, so it is left out (keys_too false) and checked against its exact
// value in the exact tier instead: within one quantization step of its group's scale.
std::vector<float> read_all(const KvStore& s, std::int64_t n, bool keys_too) {
  KvStore::Reader r(s, 0, 1);
  std::vector<float> k(kDim), v(kDim), exact(kDim), all;
  for (std::int64_t p = 0; p < n; ++p) {
    KeyBound b;
    double rho = 0.0;
    r.key(p, k.data(), b);
    r.value(p, v.data(), rho);
    if (keys_too) {
      all.insert(all.end(), k.begin(), k.end());
    } else if (r.has_exact_tier()) {  // without it the exact rows are a ring of the latest few
      r.exact_key(p, exact.data());
      for (int g = 0; g < kDim; g += 32) {
        float amax = 0.0f;
        for (int i = g; i < g + 32; ++i) amax = std::max(amax, std::fabs(exact[i]));
        for (int i = g; i < g + 32; ++i) EXPECT_LE(std::fabs(k[i] - exact[i]), amax / 127.0f * 1.01f) << p << " " << i;
      }
    }
    all.insert(all.end(), v.begin(), v.end());
    all.push_back(static_cast<float>(b.kind));
    all.push_back(static_cast<float>(rho));
  }
  return all;
}

TEST(KvStore, AClearedSequenceReturnsItsPagesAndReusedPagesCarryNothingOfIt) {
  for (const std::string& fmt : quant::kv_format_names())
    for (int page : {1, 16, 64})
      for (bool tier : {false, true}) {
        SCOPED_TRACE(fmt + " page " + std::to_string(page) + (tier ? " tier" : ""));
        const std::int64_t n = 70;
        CacheConfig cfg = test_config(1, 2, kDim, n, page, fmt, fmt, 7);
        cfg.exact_tier = tier;
        cfg.backing = BackingPlace::in_ram();
        KvStore fresh(cfg), reused(cfg);
        const std::int64_t pages = reused.pool().pages();
        write_all(reused, n, 1);
        EXPECT_EQ(reused.pool().free_pages(), 0);
        reused.clear();
        EXPECT_EQ(reused.pool().free_pages(), pages);
        EXPECT_EQ(reused.length(0, 1), 0);
        write_all(reused, n - 5, 2);
        write_all(fresh, n - 5, 2);
        const bool keys_too = fmt != quant::kDitherInt8;
        EXPECT_EQ(read_all(reused, n - 5, keys_too), read_all(fresh, n - 5, keys_too));
      }
}

}  // namespace
}  // namespace witcert::cache
