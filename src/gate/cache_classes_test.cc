// The certified cache's promises over whole classes of input rather than single examples: every
// format on both sides × every dither mode × outlier pairs {0, 1, 4} × prompts of 1 … 20 tokens ×
// page sizes 1 and 16, through prefill (as the model calls it) and decode; the joint K∧V gate;
// promoted pages; every bound shape; and the cache without an exact tier.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "attention/reference/certified_attention.h"
#include "formats/schemes.h"
#include "gate/certified_cache.h"
#include "gate/test_log.h"
#include "kvcache/test_config.h"

namespace witcert::gate {
namespace {

using namespace witcert::attention;

constexpr int kLayers = 2, kKvHeads = 1, kGroup = 3, kDim = 64, kDecode = 4;
constexpr std::int64_t kChunk = 8, kRun = 4;  // prefill chunks and attend_causal runs, as the model makes them

std::vector<std::string> formats() {
  std::vector<std::string> f = kvcache::dither_format_names();
  f.insert(f.begin(), "fp16");
  for (const std::string& s : formats::kv_scheme_names())
    if (s != "fp16") f.push_back(s);
  return f;
}

struct Case {
  Case(std::string k_fmt, std::string v_fmt, int page_size, int prompt_len)
      : k(std::move(k_fmt)), v(std::move(v_fmt)), page(page_size), prompt(prompt_len) {}
  std::string k, v;
  int page = 16;
  int prompt = 1;
  kvcache::DitherMode dither = kvcache::DitherMode::per_slot;
  int outliers = 4;
  // Keys with channel scales over blocks of 8 tokens (the prompt's last block ends with it), outlier
  // pairs fixed at 4 tokens.
  bool channel_scales = false;
  Policy gate;
  bool check = false;
  cert::BoundShape bound = cert::BoundShape::min;

  std::string name() const {
    return k + "/" + v + " page " + std::to_string(page) + " prompt " + std::to_string(prompt) + " " +
           kvcache::dither_mode_name(dither) + (channel_scales ? " channel scales" : "") + " m " + std::to_string(outliers) +
           " gate " + std::to_string(gate.tau_k()) +
           (check ? " checked" : "") + " " + cert::bound_shape_name(bound);
  }
};

struct Served {
  std::vector<float> out;          // every attention output, in call order
  std::vector<float> exact;        // the same calls on the plain exact cache
  std::vector<MeterCell> cells;
  kvcache::KvStore::PageInStats page_in;
};

// Keys with a massive RoPE pair and a spread of channel scales, values of several norms, queries
// strong enough that a damaging format moves the softmax.
struct Stream {
  std::mt19937_64 rng;
  std::normal_distribution<float> g{0.0f, 1.0f};
  explicit Stream(std::uint64_t seed) : rng(seed) {}
  void key(float* k) {
    for (int i = 0; i < kDim; ++i) k[i] = g(rng) * (i == 6 || i == 7 ? 12.0f : 1.0f + (i % 5));
  }
  void value(float* v) {
    for (int i = 0; i < kDim; ++i) v[i] = g(rng) * (1.0f + (i % 3));
  }
  void query(float* q) {
    for (int i = 0; i < kGroup * kDim; ++i) q[i] = 1.5f * g(rng);
  }
};

// Prefill of c.prompt tokens in chunks (each layer writes the chunk, then attends in causal runs),
// then kDecode decode steps, on the certified cache and on the exact cache with the same inputs.
Served serve(const Case& c) {
  const std::int64_t n = c.prompt + kDecode;
  kvcache::CacheConfig cfg = kvcache::test_config(kLayers, kKvHeads, kDim, n, c.page, c.k, c.v, 7);
  cfg.dither = c.dither;
  cfg.outlier_pairs = c.outliers;
  if (c.channel_scales) {
    cfg.key_scales = formats::ScaleGranularity::channel;
    cfg.scale_block = 8;
    cfg.calibration_tokens = 4;  // so that short prompts encode too
  }
  cfg.backing = kvcache::BackingPlace::in_ram();
  CertifiedOptions o;
  o.q_heads = kGroup * kKvHeads;
  o.decode_budget = kDecode;
  o.gate = c.gate;
  o.check_soundness = c.check;
  o.bound = c.bound;
  CellLog log;
  CertifiedKvCache cache(cfg, logged(o, log));
  ExactKvCache exact({kLayers, kKvHeads, kDim, n});
  cache.set_prompt_length(c.prompt);
  Stream s(1000 + c.prompt);
  Served r;
  std::vector<float> k(kDim), v(kDim), q(kRun * kGroup * kDim), out(q.size());
  auto step = [&](std::int64_t pos0, std::int64_t len) {
    for (int l = 0; l < kLayers; ++l) {
      for (std::int64_t p = pos0; p < pos0 + len; ++p) {
        s.key(k.data());
        s.value(v.data());
        cache.write(l, 0, p, k.data(), v.data());
        exact.write(l, 0, p, k.data(), v.data());
      }
      for (std::int64_t i = 0; i < len; i += kRun) {
        const std::int64_t m = std::min(kRun, len - i);
        for (std::int64_t j = 0; j < m; ++j) s.query(&q[j * kGroup * kDim]);
        cache.attend_causal(l, 0, q.data(), kGroup * kDim, kGroup, pos0 + i, m, 0, out.data(), kGroup * kDim);
        r.out.insert(r.out.end(), out.begin(), out.begin() + m * kGroup * kDim);
        exact.attend_causal(l, 0, q.data(), kGroup * kDim, kGroup, pos0 + i, m, 0, out.data(), kGroup * kDim);
        r.exact.insert(r.exact.end(), out.begin(), out.begin() + m * kGroup * kDim);
      }
    }
  };
  for (std::int64_t p = 0; p < c.prompt; p += kChunk) step(p, std::min<std::int64_t>(kChunk, c.prompt - p));
  for (int i = 0; i < kDecode; ++i) step(c.prompt + i, 1);
  r.cells = log.cells();
  r.page_in = cache.store().page_in_stats();
  return r;
}

// What every served case must satisfy: finite outputs, meters in range, the true TV under the K
// meter and the values' true error under the V meter where they were computed, and a certified
// gate's cells within τ_K and τ_V.
void expect_sound(const Case& c, const Served& r) {
  for (float x : r.out) ASSERT_TRUE(std::isfinite(x)) << c.name();
  ASSERT_EQ(r.cells.size(), static_cast<std::size_t>(kLayers * kGroup * (c.prompt + kDecode))) << c.name();
  for (const MeterCell& cell : r.cells) {
    ASSERT_TRUE(cell.meter >= 0.0 && cell.meter <= 1.0) << c.name();
    ASSERT_GE(cell.v_meter, 0.0) << c.name();
    ASSERT_TRUE(cell.eform_raw >= 0.0) << c.name();
    if (c.check) {
      ASSERT_LE(cell.tv, cell.meter * (1 + 1e-9) + 1e-12) << c.name() << " pos " << cell.pos;
      ASSERT_LE(cell.v_true, cell.v_meter * (1 + 1e-9) + 1e-12) << c.name() << " pos " << cell.pos;
      ASSERT_LE(cell.v_meter, cell.v_meter_sure) << c.name() << " pos " << cell.pos;
      ASSERT_FALSE(violates(cell));
    }
    if (c.gate.on() && c.gate.certified()) {
      ASSERT_LE(cell.meter, c.gate.tau_k()) << c.name() << " pos " << cell.pos;
      ASSERT_LE(cell.v_meter, c.gate.tau_v) << c.name() << " pos " << cell.pos;
    }
  }
}

// The main path never crashes nor serves a wrong bound, for every format, dither mode, outlier
// count, short prompt and page size, with and without the soundness check (which adds the exact
// tier) and gated; the cache without a tier serves bit for bit what the cache with one serves.
TEST(CacheClasses, PrefillAndDecodeOverEveryFormatModeOutliersPromptAndPage) {
  int cases = 0;
  for (const std::string& fmt : formats())
    for (int page : {1, 16})
      for (int prompt = 1; prompt <= 20; ++prompt) {
        const bool dither = kvcache::dithered(fmt);
        for (kvcache::DitherMode mode : {kvcache::DitherMode::per_slot, kvcache::DitherMode::shared_page,
                                       kvcache::DitherMode::shared_prompt})
          for (int outliers : {0, 1, 4})
            for (bool channel_scales : {false, true}) {
              if (!dither && (mode != kvcache::DitherMode::per_slot || outliers != 4 || channel_scales)) continue;
              if (channel_scales && (mode == kvcache::DitherMode::shared_page || outliers == 1)) continue;
              Case c(fmt, fmt, page, prompt);
              c.dither = mode;
              c.outliers = outliers;
              c.channel_scales = channel_scales;
              const Served plain = serve(c);
              expect_sound(c, plain);
              c.check = true;
              const Served checked = serve(c);
              expect_sound(c, checked);
              ASSERT_EQ(std::memcmp(plain.out.data(), checked.out.data(), plain.out.size() * sizeof(float)), 0) << c.name();
              c.gate = Policy::from_tau_k(0.2, Granularity::block);
              expect_sound(c, serve(c));
              cases += 3;
            }
      }
  EXPECT_EQ(cases, (16 + 4 * 13) * 2 * 20 * 3);  // 16 schemes, 9 + 4 (channel scales) variants of each dithered width
}

// A damaged value side alone triggers the joint gate: with exact keys (K meter 0) every served
// cell still ends within τ_V, pages are read in where the V meter exceeded it, and the output
// moves toward the exact one.
TEST(CacheClasses, JointGateRepairsTheValueSide) {
  for (const std::string& fmt : formats()) {
    if (fmt == "fp16") continue;
    for (int page : {1, 16})
      for (Granularity gran : {Granularity::block, Granularity::head, Granularity::request}) {
        Case raw("fp16", fmt, page, 20);
        raw.check = true;
        const Served r = serve(raw);
        expect_sound(raw, r);
        Case gated = raw;
        gated.gate = Policy::from_tau_k(0.2, gran);
        const Served g = serve(gated);
        expect_sound(gated, g);
        bool v_failed = false;
        for (const MeterCell& cell : r.cells) v_failed = v_failed || cell.v_meter > 0.05;
        EXPECT_EQ(g.page_in.page_ins > 0, v_failed) << gated.name();
        double err_raw = 0.0, err_gated = 0.0;
        for (std::size_t i = 0; i < r.out.size(); ++i) {
          err_raw += std::fabs(r.out[i] - r.exact[i]);
          err_gated += std::fabs(g.out[i] - g.exact[i]);
        }
        if (v_failed) {
          EXPECT_LT(err_gated, err_raw) << gated.name();
        }
      }
  }
}

// Every bound shape is sound on every format, and each is what it says: the minimum and the
// retention form never exceed the e-form, tanh(c_max/2) never exceeds tanh(c_max).
TEST(CacheClasses, EveryBoundShapeIsSoundOnEveryFormat) {
  using cert::BoundShape;
  for (const std::string& fmt : formats())
    for (int prompt : {3, 20}) {
      std::vector<std::vector<MeterCell>> by_shape;
      for (BoundShape shape : {BoundShape::eform, BoundShape::two_sided, BoundShape::retention, BoundShape::tanh,
                               BoundShape::tanh_half, BoundShape::min}) {
        Case c(fmt, fmt, 16, prompt);
        c.check = true;
        c.bound = shape;
        const Served r = serve(c);
        expect_sound(c, r);
        by_shape.push_back(r.cells);
      }
      for (std::size_t i = 0; i < by_shape[0].size(); ++i) {
        const double eform = by_shape[0][i].meter;
        EXPECT_EQ(by_shape[0][i].meter, std::min(1.0, by_shape[0][i].eform_raw)) << fmt;
        EXPECT_LE(by_shape[2][i].meter, eform * (1 + 1e-12)) << fmt << " retention";
        EXPECT_LE(by_shape[4][i].meter, by_shape[3][i].meter) << fmt << " tanh-half";
        EXPECT_LE(by_shape[5][i].meter, eform) << fmt << " min";
        EXPECT_LE(by_shape[5][i].meter, by_shape[1][i].meter) << fmt << " min";
        EXPECT_LE(by_shape[5][i].meter, by_shape[4][i].meter) << fmt << " min";
      }
    }
}

// Repair: a promoted page's keys and values are the backing tier's bit for bit, for every format
// on either side and both page sizes; a cache whose every page is promoted attends bit for bit as
// the plain exact cache does.
TEST(CacheClasses, PromotedPagesServeTheBackingTierBitForBit) {
  constexpr std::int64_t n = 45;
  for (const std::string& fmt : formats())
    for (int page : {1, 16})
      for (int sides = 0; sides < 3; ++sides) {
        const std::string k = sides == 1 ? "fp16" : fmt, v = sides == 2 ? "fp16" : fmt;
        kvcache::CacheConfig cfg = kvcache::test_config(kLayers, kKvHeads, kDim, n, page, k, v, 3);
        cfg.exact_tier = true;
        cfg.backing = kvcache::BackingPlace::in_ram();
        cfg.calibration_tokens = 8;
        kvcache::KvStore store(cfg);
        ExactKvCache exact({kLayers, kKvHeads, kDim, n});
        Stream s(5);
        std::vector<float> kk(kDim), vv(kDim);
        for (std::int64_t p = 0; p < n; ++p)
          for (int l = 0; l < kLayers; ++l) {
            s.key(kk.data());
            s.value(vv.data());
            store.write(l, 0, p, kk.data(), vv.data());
            exact.write(l, 0, p, kk.data(), vv.data());
          }
        const std::int64_t pages = (n + page - 1) / page;
        for (std::int64_t j = 0; j < pages; j += 2) store.promote(1, 0, j, n - 1);  // every other page of layer 1
        kvcache::KvStore::Reader r(store, 1, 0);
        std::vector<float> got(kDim), want(kDim);
        for (std::int64_t p = 0; p < n; ++p) {
          if ((p / page) % 2 != 0) continue;
          kvcache::KeyBound b;
          double rho = -1.0;
          r.key(p, got.data(), b);
          r.exact_key(p, want.data());
          ASSERT_EQ(std::memcmp(got.data(), want.data(), kDim * sizeof(float)), 0) << k << "/" << v << " pos " << p;
          ASSERT_EQ(b.kind, kvcache::KeyBound::exact);
          r.value(p, got.data(), rho);
          r.exact_value(p, want.data());
          ASSERT_EQ(std::memcmp(got.data(), want.data(), kDim * sizeof(float)), 0) << k << "/" << v << " pos " << p;
          ASSERT_EQ(rho, 0.0);
          const kvcache::KvStore::Reader::RawPage raw = r.raw_page(p);
          ASSERT_EQ(raw.k.packed_end, raw.begin);
          ASSERT_EQ(raw.v.packed_end, raw.begin);
        }
        // A gate at a threshold nothing lossy meets promotes every page at its first call; from then on
        // (that call included) every output is the exact cache's, bit for bit.
        CertifiedOptions o;
        o.q_heads = kGroup * kKvHeads;
        o.gate = Policy::from_tau_k(1e-12, Granularity::request, 1e-12);
        CellLog log;
        CertifiedKvCache gated(cfg, logged(o, log));
        Stream s2(5);
        for (std::int64_t p = 0; p < n; ++p)
          for (int l = 0; l < kLayers; ++l) {
            s2.key(kk.data());
            s2.value(vv.data());
            gated.write(l, 0, p, kk.data(), vv.data());
          }
        std::vector<float> q(kGroup * kDim), a(q.size()), e(q.size());
        for (std::int64_t ctx : {n, n - 7, std::int64_t{1}, n}) {
          s.query(q.data());
          for (int l = 0; l < kLayers; ++l) {
            gated.attend(l, 0, q.data(), kGroup, ctx, a.data());
            exact.attend(l, 0, q.data(), kGroup, ctx, e.data());
            ASSERT_EQ(std::memcmp(a.data(), e.data(), a.size() * sizeof(float)), 0) << k << "/" << v << " ctx " << ctx;
          }
        }
        for (const MeterCell& cell : log.cells()) ASSERT_EQ(cell.meter, 0.0) << k << "/" << v;
      }
}

}  // namespace
}  // namespace witcert::gate
namespace witcert::gate {
namespace {

// A causal run reads the positions before it once for all its queries. When one query's gate
// repairs pages there, the later queries of the run must see the repaired pages: every cell of
// the run within τ_K and τ_V, for every granularity, format and page size.
TEST(CacheClasses, ARepairInsideARunReachesTheRestOfTheRun) {
  constexpr std::int64_t kN = 40, kPos0 = 32, kLen = 8;
  int repaired_runs = 0;
  for (const std::string fmt : {"q8_0", "q4_0", "kivi-2bit", "dither-int4", "dither-int6", "dither-int8"})
    for (Granularity granularity : {Granularity::block, Granularity::head, Granularity::request})
      for (int page : {1, 8, 16}) {
        SCOPED_TRACE(fmt + " page " + std::to_string(page) + " " + granularity_name(granularity));
        kvcache::CacheConfig cfg = kvcache::test_config(1, 1, kDim, kN, page, fmt, fmt, 3);
        cfg.outlier_pairs = 0;
        cfg.backing = kvcache::BackingPlace::in_ram();
        CertifiedOptions o;
        o.q_heads = kGroup;
        o.gate = Policy::from_tau_k(0.002, granularity, 0.002);
        CellLog log;
        CertifiedKvCache cache(cfg, logged(o, log));
        Stream s(11);
        std::vector<float> k(kDim), v(kDim), q(kLen * kGroup * kDim), out(q.size());
        for (std::int64_t p = 0; p < kN; ++p) {
          s.key(k.data());
          s.value(v.data());
          cache.write(0, 0, p, k.data(), v.data());
        }
        for (std::int64_t j = 0; j < kLen; ++j) s.query(&q[j * kGroup * kDim]);
        cache.attend_causal(0, 0, q.data(), kGroup * kDim, kGroup, kPos0, kLen, 0, out.data(), kGroup * kDim);
        const std::vector<MeterCell> cells = log.cells();
        ASSERT_EQ(cells.size(), static_cast<std::size_t>(kLen * kGroup));
        bool any = false;
        for (const MeterCell& c : cells) {
          EXPECT_LE(c.meter, 0.002) << "pos " << c.pos << " head " << c.q_head;
          EXPECT_LE(c.v_meter, 0.002) << "pos " << c.pos << " head " << c.q_head;
          any = any || c.repaired;
        }
        EXPECT_TRUE(any) << "τ this low repairs";
        repaired_runs += any;
      }
  EXPECT_EQ(repaired_runs, 6 * 3 * 3);
}

}  // namespace
}  // namespace witcert::gate
