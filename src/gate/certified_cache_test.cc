#include "gate/certified_cache.h"
#include "gate/test_log.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "attention/reference/certified_attention.h"
#include "formats/schemes.h"
#include "kvcache/test_config.h"

namespace witcert::gate {
namespace {

using namespace witcert::attention;
using kvcache::KvCache;

constexpr int kLayers = 2, kKvHeads = 2, kGroup = 3, kDim = 64;

// Keys with a few massive RoPE-pair channels, values with a spread of norms, as real models have.
struct Tokens {
  std::vector<float> k, v;  // [layer][kv_head][pos][d]
  std::int64_t n;
  const float* key(int l, int h, std::int64_t t) const { return &k[((l * kKvHeads + h) * n + t) * kDim]; }
  const float* value(int l, int h, std::int64_t t) const { return &v[((l * kKvHeads + h) * n + t) * kDim]; }
};

Tokens draw_tokens(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  Tokens t{std::vector<float>(kLayers * kKvHeads * n * kDim), std::vector<float>(kLayers * kKvHeads * n * kDim), n};
  std::vector<float> gain(kDim);
  for (int c = 0; c < kDim; ++c) gain[c] = std::exp(0.8f * g(rng));
  gain[6] = gain[7] = 12.0f;  // one massive interleaved pair
  for (std::size_t i = 0; i < t.k.size(); ++i) {
    t.k[i] = gain[i % kDim] * g(rng);
    t.v[i] = g(rng);
  }
  return t;
}

CertifiedOptions heads(int q_heads) {
  CertifiedOptions o;
  o.q_heads = q_heads;
  return o;
}

std::vector<std::string> all_formats() {
  std::vector<std::string> f = formats::kv_scheme_names();
  for (const std::string& d : kvcache::dither_format_names()) f.push_back(d);
  return f;
}

kvcache::CacheConfig config(const std::string& k_fmt, const std::string& v_fmt, std::int64_t cap, int page,
                          std::uint64_t shuffle) {
  kvcache::CacheConfig c = kvcache::test_config(kLayers, kKvHeads, kDim, cap, page, k_fmt, v_fmt, shuffle);
  c.calibration_tokens = 8;
  return c;
}

// The same with the exact tier in RAM, for the tests that read it.
kvcache::CacheConfig config_with_tier(const std::string& k_fmt, const std::string& v_fmt, std::int64_t cap, int page,
                                    std::uint64_t shuffle) {
  kvcache::CacheConfig c = config(k_fmt, v_fmt, cap, page, shuffle);
  c.exact_tier = true;
  c.backing = kvcache::BackingPlace::in_ram();
  return c;
}

void fill(KvCache& cache, const Tokens& t) {
  for (std::int64_t p = 0; p < t.n; ++p)
    for (int l = 0; l < kLayers; ++l)
      for (int h = 0; h < kKvHeads; ++h) cache.write(l, h, p, t.key(l, h, p), t.value(l, h, p));
}

TEST(CertifiedCache, BackingTierIsWrittenOnEveryWrite) {
  const Tokens t = draw_tokens(40, 1);
  for (const std::string& fmt : all_formats()) {
    CertifiedKvCache cache(config_with_tier(fmt, fmt, 40, 16, 9), heads(kGroup * kKvHeads));
    fill(cache, t);
    for (int l = 0; l < kLayers; ++l)
      for (int h = 0; h < kKvHeads; ++h) {
        kvcache::KvStore::Reader r(cache.store(), l, h);
        for (std::int64_t p = 0; p < t.n; ++p)
          for (int i = 0; i < kDim; ++i) {
            ASSERT_EQ(r.exact_key_row(p)[i], fp16_from_float(t.key(l, h, p)[i])) << fmt;
            ASSERT_EQ(r.exact_value_row(p)[i], fp16_from_float(t.value(l, h, p)[i])) << fmt;
          }
      }
  }
}

TEST(CertifiedCache, Fp16PathIsBitIdenticalToTheExactCache) {
  const Tokens t = draw_tokens(50, 2);
  ExactKvCache plain({kLayers, kKvHeads, kDim, 50});
  CellLog log;
  CertifiedKvCache certified(config("fp16", "fp16", 50, 16, 3), logged(heads(kGroup * kKvHeads), log));
  fill(plain, t);
  fill(certified, t);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> g(0.0f, 2.0f);
  std::vector<float> q(kGroup * kDim), a(kGroup * kDim), b(kGroup * kDim);
  for (int trial = 0; trial < 20; ++trial) {
    for (float& x : q) x = g(rng);
    plain.attend(trial % 2, trial % kKvHeads, q.data(), kGroup, 1 + trial * 2, a.data());
    certified.attend(trial % 2, trial % kKvHeads, q.data(), kGroup, 1 + trial * 2, b.data());
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  }
  for (const MeterCell& c : log.cells()) EXPECT_EQ(c.meter, 0.0);
}

// The dither regenerated at read time is the one used at write time: every non-outlier element
// of a dither-int8 key is within s/2 of the exact key (a different ξ would give up to s), for
// page sizes 1 and 16, shuffled pages, and both dither modes.
TEST(CertifiedCache, DitherReadStreamEqualsWriteStream) {
  const Tokens t = draw_tokens(70, 4);
  for (int page : {1, 16})
    for (kvcache::DitherMode mode :
         {kvcache::DitherMode::per_slot, kvcache::DitherMode::shared_page, kvcache::DitherMode::shared_prompt}) {
      kvcache::CacheConfig c = config_with_tier(kvcache::kDitherInt8, "fp16", 70, page, 77);
      c.dither = mode;
      CertifiedKvCache cache(c, heads(kGroup * kKvHeads));
      cache.set_prompt_length(41);
      fill(cache, t);
      for (int l = 0; l < kLayers; ++l)
        for (int h = 0; h < kKvHeads; ++h) {
          kvcache::KvStore::Reader r(cache.store(), l, h);
          std::vector<float> k(kDim), exact(kDim);
          kvcache::KeyBound b;
          int outliers = 0;
          for (int i = 0; i < kDim; ++i) outliers += r.outlier_mask()[i];
          EXPECT_EQ(outliers, 2 * c.outlier_pairs);
          EXPECT_TRUE(r.outlier_mask()[6] && r.outlier_mask()[7]) << "the massive pair must be an outlier";
          for (std::int64_t p = 0; p < t.n; ++p) {
            r.key(p, k.data(), b);
            r.exact_key(p, exact.data());
            ASSERT_EQ(b.kind, kvcache::KeyBound::tier_b);
            for (int i = 0; i < kDim; ++i) {
              if (r.outlier_mask()[i]) {
                ASSERT_EQ(k[i], exact[i]);
                continue;
              }
              const double s = fp16_to_double(b.scales[i / 32]);
              ASSERT_LE(std::fabs(double(k[i]) - exact[i]), s / 2 * (1 + 0x1p-16)) << "page " << page << " pos " << p;
            }
          }
        }
    }
}

// shared-prompt: the prompt's keys take their page's counter word, every later key its slot's; the
// prompt length is fixed before the first write and reset by clear().
TEST(CertifiedCache, SharedPromptDitherSharesOnlyThePrompt) {
  const Tokens t = draw_tokens(70, 4);
  kvcache::CacheConfig c = config(kvcache::kDitherInt8, "fp16", 70, 16, 78);
  c.dither = kvcache::DitherMode::shared_prompt;
  CertifiedKvCache cache(c, heads(kGroup * kKvHeads));
  cache.set_prompt_length(41);
  fill(cache, t);
  EXPECT_THROW(cache.set_prompt_length(10), std::logic_error);
  kvcache::KvStore::Reader r(cache.store(), 1, 0);
  for (std::int64_t p = 0; p < t.n; ++p) {
    const kvcache::KvStore::Reader::RawPage page = r.raw_page(p);
    EXPECT_EQ(cache.store().shared_dither(p), p < 41) << p;
    EXPECT_EQ(page.shared_end, std::clamp<std::int64_t>(41, page.begin, page.end)) << p;
    const std::uint32_t word = page.counter(p);
    EXPECT_EQ(word >> 31, p < 41 ? 1u : 0u) << p;  // page words have the top bit, slot words not
    if (p % 16 == 0) continue;
    if (p < 41) {
      EXPECT_EQ(word, page.counter(p - 1)) << p;
    } else if (p > 41) {
      EXPECT_EQ(word, page.counter(p - 1) + 1) << p;  // consecutive slots
    }
  }
  cache.clear();
  EXPECT_FALSE(cache.store().shared_dither(0));
  EXPECT_NO_THROW(cache.set_prompt_length(5));
  EXPECT_THROW(cache.set_prompt_length(-1), std::invalid_argument);
}

// Soundness on every cell: for every format, page size and split count, the meter bounds the
// true TV between attention over exact and over stored keys; output and meter do not depend on
// the split count or the page layout.
TEST(CertifiedCache, MeterBoundsTrueTvForEveryFormatAndLayout) {
  const std::int64_t n = 48;
  const Tokens t = draw_tokens(n, 5);
  std::mt19937_64 rng(6);
  std::normal_distribution<float> g(0.0f, 1.5f);
  long cells = 0, violations = 0, informative = 0;
  for (const std::string& fmt : all_formats()) {
    std::vector<float> baseline_out;
    std::vector<double> baseline_meter;
    for (int page : {1, 16}) {
      // The dither is a function of the physical slot: a different page layout is a different
      // draw, so dither-int8 is compared across split counts only.
      if (fmt == kvcache::kDitherInt8) baseline_out.clear();
      for (int splits : {1, 2, 8}) {
        CertifiedOptions o;
        o.q_heads = kGroup * kKvHeads;
        o.splits = splits;
        o.check_soundness = true;
        CellLog log;
        CertifiedKvCache cache(config(fmt, fmt, n, page, 100 + page), logged(o, log));
        fill(cache, t);
        std::mt19937_64 qrng(7);  // the same queries for every layout
        std::vector<float> q(kGroup * kDim), out(kGroup * kDim), all_out;
        for (int trial = 0; trial < 12; ++trial) {
          for (float& x : q) x = std::normal_distribution<float>(0.0f, 1.5f)(qrng);
          const std::int64_t ctx = 1 + (trial * 7) % n;
          cache.attend(trial % kLayers, trial % kKvHeads, q.data(), kGroup, ctx, out.data());
          all_out.insert(all_out.end(), out.begin(), out.end());
        }
        std::vector<double> meters;
        for (const MeterCell& c : log.cells()) {
          ++cells;
          meters.push_back(c.meter);
          if (c.meter < 1.0) ++informative;
          if (!(c.tv <= c.meter * (1 + 1e-9) + 1e-12)) {
            ++violations;
            ADD_FAILURE() << fmt << " page " << page << " splits " << splits << ": TV " << c.tv << " > meter "
                          << c.meter;
          }
        }
        if (baseline_out.empty()) {
          baseline_out = all_out;
          baseline_meter = meters;
        } else {
          for (std::size_t i = 0; i < all_out.size(); ++i)
            ASSERT_NEAR(all_out[i], baseline_out[i], 1e-5 * (1 + std::fabs(baseline_out[i])))
                << fmt << " page " << page << " splits " << splits;
          for (std::size_t i = 0; i < meters.size(); ++i)
            ASSERT_NEAR(meters[i], baseline_meter[i], 1e-6 * (1e-12 + baseline_meter[i])) << fmt;
        }
      }
    }
  }
  (void)g;
  std::printf("[certified-cache] %ld cells, %ld violations, %ld informative (meter < 1)\n", cells, violations,
              informative);
  EXPECT_EQ(violations, 0);
  EXPECT_GT(informative, cells / 4) << "the 8-bit formats must give informative meters";
}

TEST(CertifiedCache, OutputIsAttentionOverTheStoredKeysAndValues) {
  const Tokens t = draw_tokens(30, 8);
  for (const std::string& fmt : {std::string("q4_0"), std::string("kivi-2bit"), std::string(kvcache::kDitherInt8)}) {
    CertifiedKvCache cache(config(fmt, fmt, 30, 16, 0), heads(kGroup * kKvHeads));
    fill(cache, t);
    std::vector<float> q(kGroup * kDim, 0.3f), out(kGroup * kDim);
    q[1] = -2.0f;
    cache.attend(1, 1, q.data(), kGroup, 30, out.data());
    kvcache::KvStore::Reader r(cache.store(), 1, 1);
    std::vector<double> z(30), want(kDim, 0.0);
    std::vector<float> k(kDim), v(kDim);
    kvcache::KeyBound b;
    double rho, mx = -1e300, sum = 0.0;
    for (int p = 0; p < 30; ++p) {
      r.key(p, k.data(), b);
      double dot = 0.0;
      for (int i = 0; i < kDim; ++i) dot += double(q[i]) * k[i];
      z[p] = dot / 8.0;
      mx = std::max(mx, z[p]);
    }
    for (int p = 0; p < 30; ++p) sum += std::exp(z[p] - mx);
    for (int p = 0; p < 30; ++p) {
      r.value(p, v.data(), rho);
      for (int i = 0; i < kDim; ++i) want[i] += std::exp(z[p] - mx) / sum * v[i];
    }
    for (int i = 0; i < kDim; ++i) EXPECT_NEAR(out[i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << fmt;
  }
}

TEST(CertifiedCache, NonFiniteKeyMeansNoGuarantee) {
  Tokens t = draw_tokens(20, 9);
  t.k[((1 * kKvHeads + 0) * t.n + 5) * kDim + 3] = NAN;  // layer 1, head 0, position 5
  for (const std::string& fmt : {std::string("rtn-int8"), std::string(kvcache::kDitherInt8)}) {
    CellLog log;
    CertifiedKvCache cache(config(fmt, "fp16", 20, 16, 0), logged(heads(kGroup * kKvHeads), log));
    fill(cache, t);
    std::vector<float> q(kGroup * kDim, 0.1f), out(kGroup * kDim);
    cache.attend(1, 0, q.data(), kGroup, 20, out.data());
    for (const MeterCell& c : log.cells()) {
      EXPECT_EQ(c.meter, 1.0) << fmt;
      EXPECT_TRUE(std::isinf(c.eform_raw)) << fmt;
    }
  }
}

// Two sequences over one pool: a NaN in one's keys gives it no guarantee (infinite raw score,
// meter 1) and a repair when gated; the other's outputs and cells are bit for bit its own alone.
TEST(CertifiedCache, ANonFiniteKeyInOneSequenceLeavesTheOthersUnchanged) {
  const Tokens bad_tokens = [] {
    Tokens t = draw_tokens(40, 9);
    t.k[((1 * kKvHeads + 0) * t.n + 5) * kDim + 3] = NAN;  // layer 1, head 0, position 5
    return t;
  }();
  const Tokens good_tokens = draw_tokens(40, 10);
  for (const std::string& fmt : {std::string("q4_0"), std::string(kvcache::kDitherInt8)})
    for (double tau : {0.0, 0.2}) {
      SCOPED_TRACE(fmt + " tau " + std::to_string(tau));
      CertifiedOptions o = heads(kGroup * kKvHeads);
      o.gate.set_tau_k(tau);
      kvcache::CacheConfig cfg = config_with_tier(fmt, fmt, 40, 16, 0);
      cfg.pool_pages = 6;
      auto pool = std::make_shared<kvcache::KvPool>(cfg);
      CellLog bad_log, good_log, solo_log;
      CertifiedKvCache bad(pool, logged(o, bad_log)), good(pool, logged(o, good_log));
      cfg.pool_pages = 0;
      CertifiedKvCache solo(cfg, logged(o, solo_log));
      // Interleaved, as one batched step after another writes and reads them.
      std::vector<float> q(kGroup * kDim, 0.1f), out_good(kGroup * kDim), out_solo(kGroup * kDim), out_bad(kGroup * kDim);
      for (std::int64_t p = 0; p < 40; ++p)
        for (int l = 0; l < kLayers; ++l)
          for (int h = 0; h < kKvHeads; ++h) {
            bad.write(l, h, p, bad_tokens.key(l, h, p), bad_tokens.value(l, h, p));
            good.write(l, h, p, good_tokens.key(l, h, p), good_tokens.value(l, h, p));
            solo.write(l, h, p, good_tokens.key(l, h, p), good_tokens.value(l, h, p));
            bad.attend(l, h, q.data(), kGroup, p + 1, out_bad.data());
            good.attend(l, h, q.data(), kGroup, p + 1, out_good.data());
            solo.attend(l, h, q.data(), kGroup, p + 1, out_solo.data());
            ASSERT_EQ(0, std::memcmp(out_good.data(), out_solo.data(), out_good.size() * sizeof(float)));
          }
      const std::vector<MeterCell> g = good_log.cells(), s = solo_log.cells();
      ASSERT_EQ(g.size(), s.size());
      for (std::size_t i = 0; i < g.size(); ++i) {
        EXPECT_EQ(g[i].eform_raw, s[i].eform_raw);
        EXPECT_EQ(g[i].meter, s[i].meter);
        EXPECT_EQ(g[i].v_meter, s[i].v_meter);
        EXPECT_EQ(g[i].repaired, s[i].repaired);
      }
      int no_guarantee = 0, repaired = 0;
      for (const MeterCell& c : bad_log.cells())
        if (c.layer == 1 && c.q_head < kGroup && c.pos >= 5) {
          no_guarantee += std::isinf(c.raw_before) && c.meter_before == 1.0;
          repaired += c.repaired;
        }
      EXPECT_GT(no_guarantee, 0);
      if (tau > 0) {
        EXPECT_GT(repaired, 0);
      }
    }
}

TEST(CertifiedCache, RejectsBadConfiguration) {
  EXPECT_THROW(CertifiedKvCache(config("nope", "fp16", 8, 16, 0), heads(6)), std::invalid_argument);
  CertifiedOptions bad_delta;
  bad_delta.delta_req = 1.5;
  EXPECT_THROW(CertifiedKvCache(config("fp16", "fp16", 8, 16, 0), bad_delta), std::invalid_argument);
  kvcache::CacheConfig c = config(kvcache::kDitherInt8, "fp16", 8, 16, 0);
  c.outlier_pairs = 32;
  EXPECT_THROW(CertifiedKvCache(c, heads(6)), std::invalid_argument);
  CertifiedKvCache ok(config("q8_0", "fp16", 8, 16, 0), heads(6));
  std::vector<float> k(kDim), v(kDim);
  EXPECT_THROW(ok.write(0, 0, 1, k.data(), v.data()), std::invalid_argument);  // out of order
  EXPECT_THROW(ok.write(0, 0, 8, k.data(), v.data()), std::out_of_range);
}

TEST(CertifiedCache, BytesAreMeasuredFromAllocations) {
  CertifiedKvCache fp16(config("fp16", "fp16", 4096, 16, 0), heads(6));
  CertifiedKvCache dither(config(kvcache::kDitherInt8, kvcache::kDitherInt8, 4096, 16, 0), heads(6));
  EXPECT_DOUBLE_EQ(fp16.store().bytes_per_token_head(formats::KvSide::key), 128.0);
  // No gate and no soundness check: no exact tier; a packed side keeps a ring of one page of fp16
  // rows (16 · 128 B a stream: 0.5 B a token at capacity 4096) for the tokens not yet encoded.
  EXPECT_EQ(dither.store().backing_bytes(), 0u);
  EXPECT_EQ(fp16.store().backing_bytes(), 0u);
  // int8 codes (64) + two fp16 scales (4) + m = 4 pairs in fp16 (16) + the mask amortized; the
  // ring is a fixed buffer, counted in compressed_bytes but not per token.
  EXPECT_NEAR(dither.store().bytes_per_token_head(formats::KvSide::key), 84.0, 0.1);
  // Values: codes (64) + two fp16 scales (4) + the page's float max_t(‖v̂_t‖ + ρ_t) over 16 tokens.
  EXPECT_DOUBLE_EQ(dither.store().bytes_per_token_head(formats::KvSide::value), 68.25);
  const double streams = kLayers * kKvHeads, ring = 2 * streams * 16 * 128;  // one page of fp16 rows a side
  EXPECT_NEAR(static_cast<double>(dither.store().compressed_bytes()),
              streams * 4096 * (84.0 + 68.25) + ring, streams * 4096 * 0.1);
  // + the mask, and each page's name (4 B a page of 16 tokens).
  EXPECT_EQ(fp16.store().compressed_bytes(), static_cast<std::size_t>(streams * (4096 * 256 + kDim) + 4096 / 16 * 4));
  // A gate keeps the tier: 2 · 128 B a token and KV head, in a file unless asked for RAM.
  CertifiedOptions gated = heads(6);
  gated.gate = Policy::from_tau_k(0.2, Granularity::block);
  CertifiedKvCache with_tier(config(kvcache::kDitherInt8, kvcache::kDitherInt8, 4096, 16, 0), gated);
  EXPECT_EQ(with_tier.store().backing_bytes(), 2u * kLayers * kKvHeads * 4096 * 128);
  std::printf("[certified-cache] bytes/token/head at d=64: fp16 K %.2f, dither-int8 K %.2f V %.2f\n",
              fp16.store().bytes_per_token_head(formats::KvSide::key),
              dither.store().bytes_per_token_head(formats::KvSide::key),
              dither.store().bytes_per_token_head(formats::KvSide::value));
}

}  // namespace
}  // namespace witcert::gate
