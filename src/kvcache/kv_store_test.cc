// The store as a pool plus one sequence's state: a cleared sequence returns every page, a page
// written again serves only what its new sequence wrote, and sequences sharing one pool each
// read back exactly what they read alone, for every format, page size and dither mode.
#include "kvcache/kv_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/alloc_counter.h"
#include "formats/kv_format.h"
#include "kvcache/kv_cache.h"
#include "kvcache/test_config.h"

namespace witcert::kvcache {
namespace {

constexpr int kDim = 64;

// The key and value of (sequence seed, position, head): the same numbers whoever writes them when.
void token(std::uint64_t seed, std::int64_t p, int h, std::vector<float>& k, std::vector<float>& v) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<std::uint64_t>(p) * 2 + static_cast<std::uint64_t>(h));
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int i = 0; i < kDim; ++i) k[i] = g(rng), v[i] = g(rng);
  if (p % 7 == 3) k[5] *= 40.0f;  // an outlier channel now and then
}

void write_range(KvStore& s, std::int64_t b, std::int64_t e, std::uint64_t seed) {
  std::vector<float> k(kDim), v(kDim);
  for (std::int64_t p = b; p < e; ++p)
    for (int h = 0; h < 2; ++h) {
      token(seed, p, h, k, v);
      s.write(0, h, p, k.data(), v.data());
    }
}

void write_all(KvStore& s, std::int64_t n, std::uint64_t seed) { write_range(s, 0, n, seed); }

// Every decoded key and value of stream (0, 1), with each key's bound kind and each value's ρ.
// With keys_too false the keys are left out and checked against their exact values in the exact
// tier instead: within one quantization step of their group's scale.
std::vector<float> read_all(const KvStore& s, std::int64_t n, bool keys_too = true) {
  const int q = formats::dither_max_code(std::max(s.config().k_format.dither_bits(), 2));
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
        for (int i = g; i < g + 32; ++i) EXPECT_LE(std::fabs(k[i] - exact[i]), amax / static_cast<float>(q) * 1.01f) << p << " " << i;
      }
    }
    all.insert(all.end(), v.begin(), v.end());
    all.push_back(static_cast<float>(b.kind));
    all.push_back(static_cast<float>(rho));
  }
  return all;
}

TEST(KvStore, AClearedSequenceReturnsItsPagesAndReusedPagesCarryNothingOfIt) {
  for (const std::string& fmt : formats::kv_format_names())
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
        // Every format, dither-int8 keys too: a page's dither is named by its writer, not its place.
        EXPECT_EQ(read_all(reused, n - 5), read_all(fresh, n - 5));
        if (dithered(fmt)) read_all(reused, n - 5, false);  // and near the exact keys
      }
}

TEST(KvStore, SequencesInOnePoolEachReadWhatTheyReadAlone) {
  for (const std::string& fmt : formats::kv_format_names())
    for (int page : {1, 16, 64})
      for (DitherMode mode : {DitherMode::per_slot, DitherMode::shared_page, DitherMode::shared_prompt}) {
        if (!dithered(fmt) && mode != DitherMode::per_slot) continue;
        SCOPED_TRACE(fmt + " page " + std::to_string(page) + " " + dither_mode_name(mode));
        const std::int64_t lengths[3] = {70, 33, 129};
        CacheConfig cfg = test_config(1, 2, kDim, 129, page, fmt, fmt, page == 16 ? 11 : 0);
        cfg.dither = mode;
        cfg.exact_tier = true;
        cfg.backing = BackingPlace::in_ram();
        // Room for the three at once, and for a fourth once the second has gone.
        std::int64_t pages = 0;
        for (std::int64_t n : lengths) pages += (n + page - 1) / page;
        cfg.pool_pages = pages;
        auto pool = std::make_shared<KvPool>(cfg);
        std::vector<std::unique_ptr<KvStore>> seqs;
        for (int i = 0; i < 3; ++i) {
          seqs.push_back(std::make_unique<KvStore>(pool));
          seqs.back()->set_prompt_length(lengths[i] / 2);
        }
        // Interleaved writes, a few positions at a time, as a batched step writes them.
        for (std::int64_t p = 0; p < 129; p += 5)
          for (int i = 0; i < 3; ++i) write_range(*seqs[i], std::min(p, lengths[i]), std::min(p + 5, lengths[i]), i + 1);
        EXPECT_EQ(pool->free_pages(), 0);
        for (int i = 0; i < 3; ++i) {
          CacheConfig solo_cfg = cfg;
          solo_cfg.pool_pages = 0;
          KvStore solo(solo_cfg);
          solo.set_prompt_length(lengths[i] / 2);
          write_all(solo, lengths[i], i + 1);
          EXPECT_EQ(read_all(*seqs[i], lengths[i]), read_all(solo, lengths[i])) << "sequence " << i;
        }
        // The second returns its pages; a fourth takes them and reads only its own values.
        const std::int64_t held = seqs[1]->sequence().pages();
        seqs[1].reset();
        EXPECT_EQ(pool->free_pages(), held);
        KvStore fourth(pool);
        fourth.set_prompt_length(10);
        write_all(fourth, lengths[1], 9);
        CacheConfig solo_cfg = cfg;
        solo_cfg.pool_pages = 0;
        KvStore solo(solo_cfg);
        solo.set_prompt_length(10);
        write_all(solo, lengths[1], 9);
        EXPECT_EQ(read_all(fourth, lengths[1]), read_all(solo, lengths[1]));
        EXPECT_EQ(read_all(*seqs[0], lengths[0]).size(), static_cast<std::size_t>(lengths[0]) * (kDim * 2 + 2));
        // The pool is full again: one more page is refused with a clear error, nothing written.
        KvStore fifth(pool);
        std::vector<float> k(kDim, 1.0f), v(kDim, 1.0f);
        EXPECT_THROW(fifth.write(0, 0, 0, k.data(), v.data()), std::runtime_error);
        EXPECT_EQ(fifth.length(0, 0), 0);
      }
}

TEST(KvStore, ASharedPrefixReadsAsIfWrittenAndItsPagesLiveWhileHeld) {
  for (const std::string& fmt : formats::kv_format_names())
    for (int page : {16, 32}) {
      SCOPED_TRACE(fmt + " page " + std::to_string(page));
      const std::int64_t n = 150, shared = 64;
      CacheConfig cfg = test_config(1, 2, kDim, n, page, fmt, fmt, 0);
      cfg.dither = DitherMode::shared_prompt;
      cfg.pool_pages = 3 * ((n + page - 1) / page);
      auto pool = std::make_shared<KvPool>(cfg);
      auto donor = std::make_unique<KvStore>(pool);
      donor->set_prompt_length(100);
      write_all(*donor, 90, 4);  // the donor's prompt, partly run
      KvStore taker(pool);
      taker.set_prompt_length(120);
      const std::int64_t free_before = pool->free_pages();
      EXPECT_FALSE(taker.share_prefix(*donor, 20)) << "not a whole number of pages";
      EXPECT_FALSE(taker.share_prefix(*donor, 96 + page)) << "beyond what the donor wrote";
      ASSERT_TRUE(taker.share_prefix(*donor, shared));
      EXPECT_EQ(pool->free_pages(), free_before);  // shared, not copied
      // The taker's own tokens from the prefix on (the same tokens as the donor's up to 64: the
      // same seed), then the donor goes: the shared pages stay with the taker.
      write_range(taker, shared, n, 4);
      donor.reset();
      CacheConfig solo_cfg = cfg;
      solo_cfg.pool_pages = 0;
      KvStore solo(solo_cfg);
      solo.set_prompt_length(120);
      write_all(solo, n, 4);
      EXPECT_EQ(read_all(taker, n), read_all(solo, n));
      const std::int64_t held = taker.sequence().pages();
      EXPECT_EQ(pool->free_pages(), pool->pages() - held);
      taker.clear();
      EXPECT_EQ(pool->free_pages(), pool->pages());
      KvStore other(std::make_shared<KvPool>(cfg));
      EXPECT_THROW(other.share_prefix(solo, shared), std::logic_error);
    }
}

TEST(KvStore, ASharedPrefixTakesTheDonorsRepairsMadeBeforeItsEndAndChargesThemOnce) {
  for (const std::string& fmt : {std::string("q8_0"), std::string(formats::kDitherInt8), std::string("kivi-2bit")})
    for (int page : {1, 16}) {
      SCOPED_TRACE(fmt + " page " + std::to_string(page));
      const std::int64_t n = 160, shared = 128;
      CacheConfig cfg = test_config(1, 2, kDim, n, page, fmt, fmt, 0);
      cfg.exact_tier = true;
      cfg.pool_pages = 3 * ((n + page - 1) / page);
      auto pool = std::make_shared<KvPool>(cfg);
      KvStore donor(pool);
      donor.set_prompt_length(n);
      write_all(donor, n, 9);
      // Repairs asked for by positions before the shared end, at it and after it, on pages
      // inside the prefix, on both streams.
      const std::int64_t p0 = 0, p1 = 32 / page, p2 = 64 / page, p3 = 96 / page;
      ASSERT_TRUE(donor.promote(0, 0, p0, 5));
      ASSERT_TRUE(donor.promote(0, 1, p1, shared - 1));
      ASSERT_TRUE(donor.promote(0, 0, p2, shared));
      ASSERT_TRUE(donor.promote(0, 1, p3, n - 1));
      EXPECT_FALSE(donor.promote(0, 0, p0, 140)) << "a page is promoted once";
      EXPECT_EQ(donor.page_in_stats().page_ins, 4);

      KvStore taker(pool);
      taker.set_prompt_length(n);
      ASSERT_TRUE(taker.share_prefix(donor, shared));
      EXPECT_TRUE(taker.promoted(0, 0, p0));
      EXPECT_TRUE(taker.promoted(0, 1, p1));
      EXPECT_FALSE(taker.promoted(0, 0, p2)) << "asked for at the shared end: the donor's own";
      EXPECT_FALSE(taker.promoted(0, 1, p3)) << "asked for after the shared end: the donor's own";
      EXPECT_FALSE(taker.promoted(0, 1, p0));
      const KvStore::PageInStats got = taker.page_in_stats();
      EXPECT_EQ(got.page_ins, 0) << "paged in by the donor, not again";
      EXPECT_EQ(got.page_in_bytes, 0);
      EXPECT_EQ(got.shared_page_ins, 2);
      // What the taker reads is what a sequence that wrote the same tokens and made the same
      // repairs before the shared end reads, and its repairs from then on are its own.
      write_range(taker, shared, n, 9);
      KvStore solo(pool);
      solo.set_prompt_length(n);
      write_all(solo, n, 9);
      ASSERT_TRUE(solo.promote(0, 0, p0, 5));
      ASSERT_TRUE(solo.promote(0, 1, p1, shared - 1));
      EXPECT_EQ(read_all(taker, n), read_all(solo, n));
      EXPECT_FALSE(taker.promote(0, 1, p1, n - 1)) << "a taken repair holds";
      EXPECT_TRUE(taker.promote(0, 0, p2, n - 1));
      EXPECT_EQ(taker.page_in_stats().page_ins, 1);
      EXPECT_EQ(donor.page_in_stats().page_ins, 4) << "the donor's count is unchanged";
      taker.clear();
      EXPECT_EQ(taker.page_in_stats().shared_page_ins, 0);
      EXPECT_FALSE(taker.promoted(0, 0, p0));
      EXPECT_THROW(solo.promote(0, 0, p3, n), std::out_of_range) << "a position beyond the capacity";
    }
}

TEST(KvStore, PoolAndSequenceBytesAreMeasured) {
  CacheConfig cfg = test_config(2, 2, kDim, 256, 16, formats::kDitherInt8, "q4_0", 0);
  cfg.pool_pages = 40;
  auto pool = std::make_shared<KvPool>(cfg);
  const std::size_t before = pool->bytes();
  KvStore a(pool), b(pool);
  write_all(a, 100, 1);
  EXPECT_EQ(pool->bytes(), before);  // pages are allocated with the pool, never per write
  EXPECT_GT(a.sequence().bytes(), 0u);
  EXPECT_EQ(a.sequence().pages(), 7);
  EXPECT_EQ(b.sequence().pages(), 0);
  EXPECT_EQ(pool->free_pages(), 33);
  // A sequence's own state is allocated when it is made: admission's count of a new sequence is
  // what it holds when full.
  const std::size_t fresh = b.sequence().bytes();
  write_all(b, 256, 2);
  EXPECT_EQ(b.sequence().pages(), 16);
  EXPECT_EQ(b.sequence().bytes(), fresh);
  EXPECT_EQ(a.sequence().bytes(), fresh);
}

// Every decoded key and value of (layer, head) over [b, e), with the bound's kind and ρ.
std::vector<float> read_range(const KvStore& s, int layer, int head, std::int64_t b, std::int64_t e) {
  KvStore::Reader r(s, layer, head);
  std::vector<float> k(kDim), v(kDim), all;
  for (std::int64_t p = b; p < e; ++p) {
    KeyBound kb;
    double rho = 0.0;
    r.key(p, k.data(), kb);
    r.value(p, v.data(), rho);
    all.insert(all.end(), k.begin(), k.end());
    all.insert(all.end(), v.begin(), v.end());
    all.push_back(static_cast<float>(kb.kind));
    all.push_back(static_cast<float>(rho));
  }
  return all;
}

// Positions [b, e) of both layers and heads (layer l's token differs from layer 0's by its seed).
void write_layers(KvStore& s, std::int64_t b, std::int64_t e, std::uint64_t seed) {
  std::vector<float> k(kDim), v(kDim);
  for (std::int64_t p = b; p < e; ++p)
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) {
        token(seed + l, p, h, k, v);
        s.write(l, h, p, k.data(), v.data());
      }
}

// Layer 0 has a window of 20 positions, layer 1 none. Run in passes (prefill chunks, then single
// decode steps), each retiring what the queries before it read: the windowed layer holds its
// window's pages and the current pass's, no more, and every position a later query can read
// decodes exactly as in a store that retires nothing, for every format, dither mode and page size
// (pages in a shuffled order). A retired page goes back to the pool and is written again at once,
// so a page retired too early would be read back overwritten.
TEST(KvStore, AWindowedLayerHoldsItsWindowsPagesAndReadsAsIfItKeptEverything) {
  constexpr std::int64_t W = 20, n = 150;
  const std::vector<std::int64_t> passes = {0, 37, 64, 90, 91, 92, 93, 120, 121, 149, n};
  long reads = 0;
  for (const std::string& fmt : formats::kv_format_names())
    for (const DitherMode mode :
         {DitherMode::per_slot, DitherMode::shared_page, DitherMode::shared_prompt, DitherMode::none})
      for (int page : {1, 5, 16}) {
        if (!dithered(fmt) && mode != DitherMode::per_slot) continue;
        SCOPED_TRACE(fmt + " " + dither_mode_name(mode) + " page " + std::to_string(page));
        CacheConfig all_cfg = test_config(2, 2, kDim, n, page, fmt, fmt, 7);
        all_cfg.dither = mode;
        all_cfg.exact_tier = true;
        CacheConfig cfg = all_cfg;
        cfg.windows = {W, 0};
        KvStore windowed(cfg), all(all_cfg);
        windowed.set_prompt_length(64);
        all.set_prompt_length(64);
        for (std::size_t i = 0; i + 1 < passes.size(); ++i) {
          const std::int64_t b = passes[i], e = passes[i + 1];
          windowed.retire_before(b);
          write_layers(windowed, b, e, 3);
          write_layers(all, b, e, 3);
          const std::int64_t from = window_begin(b, W);
          EXPECT_LE(windowed.retired_end(0), from / page * page);
          // Retired up to the window, or to a group-scheme block still filling.
          const int T = std::max(1, cfg.k_format.kind() == FormatKind::scheme
                                        ? cfg.k_format.scheme(formats::KvSide::key)->tokens_per_block()
                                        : 1);
          EXPECT_EQ(windowed.retired_end(0), std::min(from, b / T * T) / page * page);
          EXPECT_EQ(windowed.retired_end(1), 0);
          EXPECT_EQ(windowed.sequence().window_pages(), (e + page - 1) / page - windowed.retired_end(0) / page);
          EXPECT_EQ(windowed.sequence().pages(), all.sequence().pages());
          for (int h = 0; h < 2; ++h) {
            ASSERT_EQ(read_range(windowed, 0, h, from, e), read_range(all, 0, h, from, e)) << "pass " << b;
            ASSERT_EQ(read_range(windowed, 1, h, 0, e), read_range(all, 1, h, 0, e)) << "pass " << b;
            reads += 2 * (e - from) + e;
          }
          // A retired page is no longer repaired (nothing reads it); a live one still is.
          if (from >= page) {
            EXPECT_FALSE(windowed.promote(0, 0, 0, e - 1));
          }
          EXPECT_EQ(windowed.promote(0, 1, (e - 1) / page, e - 1), all.promote(0, 1, (e - 1) / page, e - 1));
          EXPECT_TRUE(windowed.promoted(0, 1, (e - 1) / page));
        }
        windowed.clear();
        EXPECT_EQ(windowed.sequence().window_pages(), 0);
        EXPECT_EQ(windowed.pool().free_pages(), windowed.pool().pages());
      }
  std::printf("[window] %ld windowed reads equal to a store that keeps every page\n", reads);
}

// A sequence may share a windowed donor's prefix only while the donor still holds the pages its
// first query reads; it then reads them as the donor does, and its own retired pages go back
// without taking the donor's.
TEST(KvStore, AWindowedPrefixIsSharedOnlyWhileTheDonorHoldsTheTakersWindow) {
  constexpr std::int64_t W = 20, n = 120;
  for (int page : {4, 16}) {
    CacheConfig cfg = test_config(2, 2, kDim, n, page, formats::kDitherInt8, "q4_0", 0);
    cfg.windows = {W, 0};
    cfg.dither = DitherMode::shared_prompt;
    cfg.pool_pages = 3 * ((n + page - 1) / page);
    auto pool = std::make_shared<KvPool>(cfg);
    KvStore donor(pool);
    donor.set_prompt_length(100);
    write_layers(donor, 0, 64, 5);
    donor.retire_before(64);
    KvStore taker(pool), late(pool);
    taker.set_prompt_length(100);
    late.set_prompt_length(100);
    ASSERT_TRUE(taker.share_prefix(donor, 64)) << page;  // the donor holds [44, 64)
    write_layers(donor, 64, 96, 5);
    donor.retire_before(96);  // now from 76 on
    EXPECT_FALSE(late.share_prefix(donor, 64)) << page;
    write_layers(taker, 64, 96, 5);
    for (int h = 0; h < 2; ++h)
      EXPECT_EQ(read_range(taker, 0, h, window_begin(95, W), 96), read_range(donor, 0, h, window_begin(95, W), 96));
    taker.retire_before(96);
    EXPECT_EQ(read_range(donor, 0, 1, 80, 96), read_range(taker, 0, 1, 80, 96));
    taker.clear();
    donor.clear();
    EXPECT_EQ(pool->free_pages(), pool->pages());
  }
}

// One block's encode and decode of `scheme` on this thread, which grows the codec's scratch
// arrays (formats/scheme_kit.h) to their size for kDim; nothing without a scheme.
void warm_codec(const formats::KvScheme* scheme) {
  if (scheme == nullptr) return;
  std::vector<float> x(static_cast<std::size_t>(scheme->tokens_per_block()) * kDim, 0.5f), out(x.size());
  std::vector<std::uint8_t> packed(scheme->block_bytes(kDim));
  scheme->encode(x.data(), kDim, packed.data());
  scheme->decode(packed.data(), kDim, out.data());
}

// Once a sequence has written its first position (and the thread's codec scratch has grown), a
// write allocates nothing, for every format (fp16, dither-int8 in every dither mode, per-token
// and group schemes, research codecs included), with and without the exact tier, across page
// boundaries, dither-int8's calibration and group-scheme blocks, with layer 0 retiring its pages
// behind a window as it goes.
TEST(KvStore, AWriteAllocatesNothingOnceWarm) {
  const std::int64_t n = 80;  // 5 pages; calibration at 16; group blocks end at 32 and 64
  std::vector<float> k(kDim), v(kDim);
  for (const std::string& name : formats::kv_format_names())
    for (const DitherMode mode :
         {DitherMode::per_slot, DitherMode::shared_page, DitherMode::shared_prompt, DitherMode::none})
      for (const bool tier : {false, true}) {
        if (!dithered(name) && mode != DitherMode::per_slot) continue;
        CacheConfig c = test_config(2, 2, kDim, n, 16, name, name, 0);
        c.dither = mode;
        c.exact_tier = tier;
        c.windows = {24, 0};  // layer 0 retires its pages as it goes
        KvStore s(c);
        if (mode == DitherMode::shared_prompt) s.set_prompt_length(20);
        const formats::KvFormat& f = c.k_format;
        warm_codec(f.scheme(formats::KvSide::key));
        warm_codec(f.scheme(formats::KvSide::value));
        long before = 0;
        for (std::int64_t p = 0; p < n; ++p)
          for (int l = 0; l < 2; ++l)
            for (int h = 0; h < 2; ++h) {
              if (p == 1 && l == 0 && h == 0) before = testing_util::thread_allocations();  // after the warm-up
              if (l == 0 && h == 0) s.retire_before(p);
              token(9, p, h, k, v);
              s.write(l, h, p, k.data(), v.data());
            }
        EXPECT_EQ(testing_util::thread_allocations() - before, 0)
            << name << " dither " << dither_mode_name(mode) << (tier ? " with" : " without") << " the exact tier";
      }
}

// Dithered keys with channel scales (CacheConfig::key_scales = channel): each block's scales are
// its channels' amax over exactly the block's tokens, a key is served from its packed form from the
// moment its block is complete (the prompt's last block ending with the prompt), within half a step
// of its exact value on every channel, for every width × dither mode × page size × prompt length,
// with and without the exact tier, through prefix sharing and a windowed layer's retirement.

// The blocks of channel scales as CacheConfig::key_scales states them, computed apart from the store.
struct Blocks {
  std::int64_t T, prompt;
  std::int64_t begin(std::int64_t pos) const { return pos < prompt ? pos / T * T : prompt + (pos - prompt) / T * T; }
  std::int64_t end(std::int64_t pos) const {
    return pos < prompt ? std::min(pos / T * T + T, prompt) : begin(pos) + T;
  }
};

// Reads every key of (0, h) below n and checks it against the exact keys the test wrote: served
// exact (bound kind exact) until its block is complete and the outlier pairs are fixed, then
// decoded within half a step of the block's channel scale, which is amax/(Q − ½) rounded up to
// fp16 over exactly the block's non-outlier tokens. Returns the decoded keys.
std::vector<float> check_keys(const KvStore& s, int h, std::int64_t n, std::uint64_t seed, const Blocks& blocks) {
  const CacheConfig& cfg = s.config();
  const int bits = cfg.k_format.dither_bits();
  KvStore::Reader r(s, 0, h);
  std::vector<float> k(kDim), v(kDim), k_hat(kDim), all;
  std::vector<float> exact(static_cast<std::size_t>(n) * kDim);
  for (std::int64_t p = 0; p < n; ++p) {
    token(seed, p, h, k, v);
    for (int c = 0; c < kDim; ++c) exact[p * kDim + c] = fp16_to_float(fp16_from_float(k[c]));
  }
  const std::uint8_t* outlier = r.outlier_mask();
  for (std::int64_t p = 0; p < n; ++p) {
    KeyBound b;
    r.key(p, k_hat.data(), b);
    all.insert(all.end(), k_hat.begin(), k_hat.end());
    const bool complete = blocks.end(p) <= n && n >= cfg.calibration_tokens;
    if (!complete) {
      EXPECT_EQ(b.kind, KeyBound::exact) << "pos " << p;
      for (int c = 0; c < kDim; ++c) EXPECT_EQ(k_hat[c], exact[p * kDim + c]) << "pos " << p;
      continue;
    }
    EXPECT_EQ(b.kind, cfg.dither == DitherMode::none ? KeyBound::rounded : KeyBound::tier_b) << "pos " << p;
    EXPECT_EQ(b.scale_group, 1);
    for (int c = 0; c < kDim; ++c) {
      if (outlier[c]) {
        EXPECT_EQ(k_hat[c], exact[p * kDim + c]) << "pos " << p << " outlier channel " << c;
        continue;
      }
      double amax = 0.0;
      for (std::int64_t t = blocks.begin(p); t < blocks.end(p); ++t) amax = std::max(amax, std::fabs(double(exact[t * kDim + c])));
      const f16 want = fp16_from_double(amax / formats::dither_scale_divisor(bits), Round::up);
      EXPECT_EQ(b.scales[c], want) << "pos " << p << " channel " << c;
      const double step = fp16_to_double(want);
      EXPECT_LE(std::fabs(double(k_hat[c]) - exact[p * kDim + c]), step * (0.5 + 0x1p-17)) << "pos " << p << " channel " << c;
    }
  }
  return all;
}

TEST(ChannelScales, EachBlockIsEncodedWhenCompleteWithinHalfAStepOfItsOwnScale) {
  long keys = 0;
  for (int bits : formats::kDitherBits)
    for (const DitherMode mode :
         {DitherMode::per_slot, DitherMode::shared_page, DitherMode::shared_prompt, DitherMode::none})
      for (int page : {1, 5, 16})
        for (const std::int64_t prompt : {0, 7, 37, 48, 61})
          for (const std::int64_t T : {16, 256}) {
            const std::string fmt(formats::KvFormat::dither(bits).name());
            SCOPED_TRACE(fmt + " " + dither_mode_name(mode) + " page " + std::to_string(page) + " prompt " +
                         std::to_string(prompt) + " block " + std::to_string(T));
            constexpr std::int64_t n = 100;
            CacheConfig cfg = test_config(1, 2, kDim, n, page, fmt, "fp16", 3);
            cfg.dither = mode;
            cfg.key_scales = formats::ScaleGranularity::channel;
            cfg.scale_block = static_cast<int>(T);
            cfg.calibration_tokens = 8;
            cfg.exact_tier = true;
            CacheConfig no_tier = cfg;
            no_tier.exact_tier = false;
            KvStore s(cfg), ring(no_tier);
            s.set_prompt_length(prompt);
            ring.set_prompt_length(prompt);
            const Blocks blocks{T, prompt};
            for (const std::int64_t e : {std::int64_t{5}, std::int64_t{8}, prompt, prompt + 1, std::int64_t{70}, n}) {
              const std::int64_t b = s.length(0, 0);
              if (e <= b) continue;
              write_range(s, b, e, 5);
              write_range(ring, b, e, 5);
              for (int h = 0; h < 2; ++h) {
                const std::vector<float> with = check_keys(s, h, e, 5, blocks);
                // Without the tier the unencoded keys come from the ring: bit for bit the same reads.
                ASSERT_EQ(with, check_keys(ring, h, e, 5, blocks)) << "written " << e;
                keys += e;
              }
            }
          }
  std::printf("[channel scales] %ld keys checked against their block's scale\n", keys);
}

// A block's scales cover only its own tokens: a token written after the block is complete (the
// first decode token after the prompt) does not change the prompt's keys, whatever its size.
TEST(ChannelScales, ALaterTokenChangesNoEncodedKey) {
  for (int bits : formats::kDitherBits) {
    const std::string fmt(formats::KvFormat::dither(bits).name());
    CacheConfig cfg = test_config(1, 2, kDim, 64, 16, fmt, fmt, 0);
    cfg.key_scales = formats::ScaleGranularity::channel;
    cfg.scale_block = 32;
    cfg.exact_tier = true;
    KvStore s(cfg);
    s.set_prompt_length(40);
    write_range(s, 0, 40, 2);
    const std::vector<float> before = check_keys(s, 1, 40, 2, {32, 40});
    std::vector<float> k(kDim, 1e4f), v(kDim, 0.0f);  // huge on every channel
    for (int h = 0; h < 2; ++h) s.write(0, h, 40, k.data(), v.data());
    KvStore::Reader r(s, 0, 1);
    std::vector<float> k_hat(kDim), after;
    KeyBound b;
    for (std::int64_t p = 0; p < 40; ++p) {
      r.key(p, k_hat.data(), b);
      after.insert(after.end(), k_hat.begin(), k_hat.end());
    }
    EXPECT_EQ(before, after) << fmt;
    r.key(40, k_hat.data(), b);
    EXPECT_EQ(b.kind, KeyBound::exact) << fmt;  // its block [40, 72) is not complete
  }
}

// A prefix is shared only on a boundary of the blocks (so that its scales are the taker's own);
// the taker then reads every key as the donor does and as it would have written them itself.
TEST(ChannelScales, APrefixIsSharedOnBlockBoundariesOnly) {
  for (int page : {4, 16}) {
    CacheConfig cfg = test_config(1, 2, kDim, 128, page, formats::kDitherInt8, "q4_0", 0);
    cfg.key_scales = formats::ScaleGranularity::channel;
    cfg.scale_block = 32;
    cfg.dither = DitherMode::shared_prompt;
    cfg.exact_tier = true;
    cfg.pool_pages = 3 * (128 / page);
    auto pool = std::make_shared<KvPool>(cfg);
    KvStore donor(pool), taker(pool), odd(pool);
    for (KvStore* s : {&donor, &taker, &odd}) s->set_prompt_length(100);
    write_range(donor, 0, 100, 4);
    EXPECT_FALSE(odd.share_prefix(donor, 48)) << page;  // a whole number of pages, not of blocks
    ASSERT_TRUE(taker.share_prefix(donor, 64)) << page;
    write_range(taker, 64, 100, 4);
    const Blocks blocks{32, 100};
    EXPECT_EQ(check_keys(taker, 0, 100, 4, blocks), check_keys(donor, 0, 100, 4, blocks)) << page;
    KvStore alone(cfg);
    alone.set_prompt_length(100);
    write_range(alone, 0, 100, 4);
    EXPECT_EQ(check_keys(taker, 1, 100, 4, blocks), check_keys(alone, 1, 100, 4, blocks)) << page;
  }
}

// A windowed layer keeps the pages of a block that is not complete yet (their exact rows are read
// when it is encoded), and reads every position a later query can read as a store that retires
// nothing.
TEST(ChannelScales, AWindowedLayerKeepsTheRowsOfItsUnfinishedBlock) {
  constexpr std::int64_t W = 12, n = 120;
  for (int page : {1, 4, 16})
    for (const std::int64_t prompt : {0, 30}) {
      CacheConfig all_cfg = test_config(2, 2, kDim, n, page, "dither-int5", "dither-int5", 7);
      all_cfg.key_scales = formats::ScaleGranularity::channel;
      all_cfg.scale_block = 40;
      all_cfg.exact_tier = true;
      CacheConfig cfg = all_cfg;
      cfg.windows = {W, 0};
      KvStore windowed(cfg), all(all_cfg);
      windowed.set_prompt_length(prompt);
      all.set_prompt_length(prompt);
      std::vector<float> a(kDim), b(kDim);
      for (std::int64_t p = 0; p < n; ++p) {
        windowed.retire_before(p);
        write_layers(windowed, p, p + 1, 6);
        write_layers(all, p, p + 1, 6);
        const Blocks blocks{40, prompt};
        const std::int64_t unfinished = blocks.end(p) == p + 1 ? p + 1 : blocks.begin(p);
        EXPECT_LE(windowed.retired_end(0), std::min(unfinished, window_begin(p, W)));
        KvStore::Reader rw(windowed, 0, 1), ra(all, 0, 1);
        KeyBound bw, ba;
        for (std::int64_t t = window_begin(p, W); t <= p; ++t) {
          rw.key(t, a.data(), bw);
          ra.key(t, b.data(), ba);
          ASSERT_EQ(a, b) << "page " << page << " prompt " << prompt << " pos " << p << " reads " << t;
          ASSERT_EQ(bw.kind, ba.kind);
        }
      }
    }
}

}  // namespace
}  // namespace witcert::kvcache
