#include "kvcache/backing_tier.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <random>
#include <vector>

#include "base/test_scratch.h"
#include "kvcache/kv_store.h"

namespace witcert::kvcache {
namespace {

std::string scratch(const std::string& name) { return testing_util::scratch_path("tier_" + name); }

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

std::size_t entries(const std::string& dir) {
  return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator(dir), {}));
}

TEST(BackingTier, RamNamedAndPrivateFilesHoldWhatWasWritten) {
  const std::string named = scratch("rows.bin");
  for (const BackingPlace& place : {BackingPlace::in_ram(), BackingPlace::file(named), BackingPlace{}}) {
    BackingTier tier(10, 8, place);
    EXPECT_EQ(tier.file_backed(), !place.ram);
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
    if (!place.path.empty()) {  // the file itself holds the rows (K region, then V region)
      std::ifstream f(place.path, std::ios::binary);
      std::vector<f16> disk(2 * 10 * 8);
      f.read(reinterpret_cast<char*>(disk.data()), static_cast<std::streamsize>(disk.size() * sizeof(f16)));
      ASSERT_TRUE(f.good());
      EXPECT_EQ(disk[3 * 8 + 5], 305);
      EXPECT_EQ(disk[10 * 8 + 3 * 8 + 5], 50035);
    }
  }
  EXPECT_FALSE(std::filesystem::exists(named));  // removed with its tier
}

TEST(BackingTier, UnwritablePathIsAClearError) {
  try {
    BackingTier tier(4, 8, BackingPlace::file("/nonexistent-dir/tier.bin"));
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/tier.bin"), std::string::npos) << e.what();
  }
}

// No existing file is ever destroyed: without overwrite it is refused and left as it was, and a
// symbolic link is refused with or without overwrite (its target untouched).
TEST(BackingTier, ExistingFilesAndLinksAreRefusedUntouched) {
  const std::string existing = scratch("existing.bin"), link = scratch("link.bin");
  write_file(existing, "precious model bytes");
  std::filesystem::create_symlink(existing, link);
  for (bool keep : {false, true}) {
    EXPECT_THROW(BackingTier(4, 8, BackingPlace::file(existing, false, keep)), std::runtime_error);
    for (bool overwrite : {false, true}) {
      try {
        BackingTier tier(4, 8, BackingPlace::file(link, overwrite, keep));
        FAIL() << "a link was followed";
      } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find(link), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_EQ(read_all(existing), "precious model bytes");
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  try {
    BackingTier tier(4, 8, BackingPlace::file(existing));
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("--backing-file-overwrite"), std::string::npos) << e.what();
  }
}

// Overwrite replaces the file; keep leaves it in place; two live tiers never share one file.
TEST(BackingTier, OverwriteKeepAndOneTierPerFile) {
  const std::string path = scratch("shared.bin");
  write_file(path, "old contents");
  {
    BackingTier a(4, 8, BackingPlace::file(path, true, true));
    EXPECT_EQ(std::filesystem::file_size(path), a.bytes());
    EXPECT_EQ(read_all(path), std::string(a.bytes(), '\0'));  // nothing of the old contents survives
    EXPECT_THROW(BackingTier(4, 8, BackingPlace::file(path)), std::runtime_error);
    try {
      BackingTier b(4, 8, BackingPlace::file(path, true));
      FAIL() << "two tiers shared one file";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(std::filesystem::exists(path));  // the failed second tier removed nothing
  }
  EXPECT_TRUE(std::filesystem::exists(path));  // kept
  { BackingTier c(4, 8, BackingPlace::file(path, true)); }
  EXPECT_FALSE(std::filesystem::exists(path));  // not kept
}

// The private file leaves nothing in the temporary directory, while the tier lives or after.
TEST(BackingTier, PrivateFileLeavesNothingBehind) {
  const std::string dir = scratch("tmpdir");
  std::filesystem::create_directories(dir);
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  ::setenv("TMPDIR", dir.c_str(), 1);
  {
    BackingTier tier(64, 8, BackingPlace{});
    EXPECT_TRUE(tier.file_backed());
    tier.key_row(63)[7] = 9;
    EXPECT_EQ(tier.key_row(63)[7], 9);
    EXPECT_EQ(entries(dir), 0u);
  }
  EXPECT_EQ(entries(dir), 0u);
  if (old) ::setenv("TMPDIR", saved.c_str(), 1); else ::unsetenv("TMPDIR");
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
  c.k_format = formats::KvFormat::parse("q4_0");
  c.v_format = formats::KvFormat::dither();
  c.shuffle_pages = 5;
  c.exact_tier = true;
  c.backing.path = scratch("store.bin");
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
}  // namespace witcert::kvcache
