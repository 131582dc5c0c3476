#include "cache/backing_tier.h"

#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <vector>

#include "base/test_scratch.h"
#include "cache/kv_store.h"

namespace witcert::cache {
namespace {

std::string scratch(const std::string& name) { return testing_util::scratch_path("tier_" + name); }

TEST(BackingTier, RamAndFileHoldWhatWasWritten) {
  for (const std::string& path : {std::string(), scratch("rows.bin")}) {
    BackingTier tier(10, 8, path);
    EXPECT_EQ(tier.file_backed(), !path.empty());
    EXPECT_EQ(tier.bytes(), 2u * 10 * 8 * 2);
    for (std::size_t r = 0; r < 10; ++r)
      for (int i = 0; i < 8; ++i) {
        tier.key_row(r)[i] = static_cast<f16>(r * 100 + i);
        tier.value_row(r)[i] = static_cast<f16>(50000 + r * 10 + i);
      }
    for (std::size_t r = 0; r < 10; ++r)
      for (int i = 0; i < 8; ++i) {
        ASSERT_EQ(tier.key_row(r)[i], r * 100 + i);
        ASSERT_EQ(tier.value_row(r)[i], 50000 + r * 10 + i);
      }
    if (!path.empty()) {  // the file itself holds the rows (K region, then V region)
      std::ifstream f(path, std::ios::binary);
      std::vector<f16> disk(2 * 10 * 8);
      f.read(reinterpret_cast<char*>(disk.data()), static_cast<std::streamsize>(disk.size() * sizeof(f16)));
      ASSERT_TRUE(f.good());
      EXPECT_EQ(disk[3 * 8 + 5], 305);
      EXPECT_EQ(disk[10 * 8 + 3 * 8 + 5], 50035);
    }
  }
}

TEST(BackingTier, UnwritablePathIsAClearError) {
  try {
    BackingTier tier(4, 8, "/nonexistent-dir/tier.bin");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/tier.bin"), std::string::npos) << e.what();
  }
}

// The file-backed tier returns what was written after the pool's pages are reused by a new
// request, for every slot the new request touches.
TEST(BackingTier, FileTierAfterPageReuse) {
  CacheConfig c;
  c.layers = 2;
  c.kv_heads = 2;
  c.head_dim = 64;
  c.capacity = 40;
  c.page_size = 16;
  c.k_format = "q4_0";
  c.v_format = "dither-int8";
  c.shuffle_pages = 5;
  c.backing_file = scratch("store.bin");
  KvStore store(c);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> k(64), v(64);
  auto fill = [&](std::int64_t n) {
    std::vector<std::vector<float>> written;
    for (std::int64_t p = 0; p < n; ++p)
      for (int l = 0; l < 2; ++l)
        for (int h = 0; h < 2; ++h) {
          for (int i = 0; i < 64; ++i) k[i] = g(rng), v[i] = g(rng);
          store.write(l, h, p, k.data(), v.data());
          written.push_back(k);
          written.push_back(v);
        }
    return written;
  };
  fill(40);
  store.clear();  // a new request: the pool's pages are handed out again
  const auto written = fill(33);
  std::size_t i = 0;
  for (std::int64_t p = 0; p < 33; ++p)
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) {
        KvStore::Reader r(store, l, h);
        const std::vector<float>& wk = written[i++];
        const std::vector<float>& wv = written[i++];
        for (int d = 0; d < 64; ++d) {
          ASSERT_EQ(r.exact_key_row(p)[d], fp16_from_float(wk[d]));
          ASSERT_EQ(r.exact_value_row(p)[d], fp16_from_float(wv[d]));
        }
      }
  EXPECT_EQ(store.backing_bytes(), 2u * 2 * 2 * 48 * 64 * 2);  // 3 pages of 16 slots per stream
}

}  // namespace
}  // namespace witcert::cache
