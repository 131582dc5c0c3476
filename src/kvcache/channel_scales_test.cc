// Dithered keys with channel scales (CacheConfig::key_scales = channel): each block's scales are
// its channels' amax over exactly the block's tokens, a key is served from its packed form from the
// moment its block is complete (the prompt's last block ending with the prompt), within half a step
// of its exact value on every channel, for every width × dither mode × page size × prompt length,
// with and without the exact tier, through prefix sharing and a windowed layer's retirement.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "formats/dither/dither.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_store.h"
#include "kvcache/test_config.h"

namespace witcert::kvcache {
namespace {

constexpr int kDim = 64;

void token(std::uint64_t seed, std::int64_t p, int h, std::vector<float>& k, std::vector<float>& v) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<std::uint64_t>(p) * 2 + static_cast<std::uint64_t>(h));
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int i = 0; i < kDim; ++i) k[i] = g(rng) * (1.0f + static_cast<float>(i % 7)), v[i] = g(rng);
  if (p % 11 == 4) k[9] *= 30.0f;  // a channel whose block scale one token drags up
}

void write_range(KvStore& s, std::int64_t b, std::int64_t e, std::uint64_t seed) {
  std::vector<float> k(kDim), v(kDim);
  for (std::int64_t p = b; p < e; ++p)
    for (int h = 0; h < 2; ++h) {
      token(seed, p, h, k, v);
      s.write(0, h, p, k.data(), v.data());
    }
}

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
          for (const std::int64_t T : {16, 24, 256}) {
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
      std::vector<float> k(kDim), v(kDim), a(kDim), b(kDim);
      for (std::int64_t p = 0; p < n; ++p) {
        windowed.retire_before(p);
        for (int l = 0; l < 2; ++l)
          for (int h = 0; h < 2; ++h) {
            token(6, p, h, k, v);
            windowed.write(l, h, p, k.data(), v.data());
            all.write(l, h, p, k.data(), v.data());
          }
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
