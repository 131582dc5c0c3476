#include "attention/cpu/attend.h"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "attention/cpu/warm_attend_check.h"
#include "attention/reference/certified_attention.h"
#include "base/alloc_counter.h"
#include "cert/subgaussian.h"
#include "formats/dither/code_pack.h"
#include "formats/schemes.h"
#include "kvcache/test_config.h"

namespace witcert::kernel {
namespace {

using namespace witcert::attention;

// Runs fn once per SIMD target compiled in and supported by this CPU, each forced in turn.
template <class Fn>
void for_each_target(Fn fn) {
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    fn(target);
  }
  hwy::SetSupportedTargetsForTest(0);
}

struct Format {
  std::string k, v;
  kvcache::DitherMode dither = kvcache::DitherMode::per_slot;
  std::string name() const {
    return k + (kvcache::dithered(k) && dither != kvcache::DitherMode::per_slot ? std::string("(") + kvcache::dither_mode_name(dither) + ")" : "") +
           "/" + v;
  }
};

// Every registry scheme and every dithered width in each mode on both sides, each of them on one side
// with fp16 on the other, and shared-ξ dither-int8 keys with q4_0 values.
std::vector<Format> all_formats() {
  std::vector<Format> f;
  std::vector<std::pair<std::string, kvcache::DitherMode>> names;
  for (const std::string& s : formats::kv_scheme_names()) names.push_back({s, kvcache::DitherMode::per_slot});
  for (const std::string& d : kvcache::dither_format_names())
    for (kvcache::DitherMode mode :
         {kvcache::DitherMode::per_slot, kvcache::DitherMode::shared_page, kvcache::DitherMode::shared_prompt})
      names.push_back({d, mode});
  for (const auto& [name, mode] : names) {
    f.push_back({name, name, mode});
    if (name == "fp16") continue;
    f.push_back({name, "fp16", mode});
    if (mode == kvcache::DitherMode::per_slot) f.push_back({"fp16", name, mode});
  }
  // Shared-ξ keys (the float path) with a black-box value scheme: ρ_t from the scheme's witness.
  f.push_back({kvcache::kDitherInt8, "q4_0", kvcache::DitherMode::shared_page});
  return f;
}

constexpr int kKvHeads = 2;

// A filled store: keys with a few massive RoPE-pair channels and a spread of channel gains,
// values of varied norms, as real models have.
struct Store {
  kvcache::KvStore store;
  Store(const Format& f, int d, std::int64_t n, int page, std::uint64_t seed) : Store(config(f, d, n, page, seed), d, n, seed) {}
  Store(const kvcache::CacheConfig& c, int d, std::int64_t n, std::uint64_t seed) : store(c) {
    // shared-prompt: a prompt that ends inside a page, so that a page holds shared and own dither.
    store.set_prompt_length(n / 2 - 1);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> gain(d);
    for (float& x : gain) x = std::exp(0.8f * g(rng));
    gain[6] = gain[7] = 12.0f;
    std::vector<float> k(d), v(d);
    for (std::int64_t p = 0; p < n; ++p)
      for (int h = 0; h < kKvHeads; ++h) {
        for (int c = 0; c < d; ++c) {
          k[c] = gain[c] * g(rng);
          v[c] = g(rng) * (1.0f + static_cast<float>(p % 5));
        }
        store.write(0, h, p, k.data(), v.data());
      }
  }
  static kvcache::CacheConfig config(const Format& f, int d, std::int64_t n, int page, std::uint64_t seed) {
    kvcache::CacheConfig c = kvcache::test_config(1, kKvHeads, d, n, page, f.k, f.v, seed);
    c.dither = f.dither;
    c.calibration_tokens = 8;
    c.exact_tier = true;  // the true TV reads it
    c.backing = kvcache::BackingPlace::in_ram();
    return c;
  }
};

using RangeKernel = void (*)(kvcache::KvStore::Reader&, const float*, int, int, std::int64_t, std::int64_t,
                             const BoundContext&, std::vector<HeadPartial>&, bool);

// The kernel with one workspace for the whole test binary: every test also checks that a
// workspace left by calls of other formats and sizes serves the next call as a fresh one would.
void attend_range_fast(kvcache::KvStore::Reader& r, const float* q, int group, int d, std::int64_t b, std::int64_t e,
                       const BoundContext& ctx, std::vector<HeadPartial>& p, bool meter) {
  static Workspace work;
  attend_range(work, r, q, group, d, b, e, ctx, p, meter);
}

void reference_kernel(kvcache::KvStore::Reader& r, const float* q, int group, int d, std::int64_t b, std::int64_t e,
                      const BoundContext& ctx, std::vector<HeadPartial>& p, bool) {
  attend_range_reference(r, q, group, d, b, e, ctx, p);
}

// Split-KV over page-aligned ranges of [0, n_ctx) merged under LSE weights, as CertifiedKvCache
// does: the merged partials.
std::vector<HeadPartial> attend_partials(RangeKernel kernel, kvcache::KvStore::Reader& r, const float* q, int group,
                                         int d, std::int64_t n_ctx, int splits, bool meter = true) {
  const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), n_ctx,
                         cert::delta_loc(1e-2, 1, group * kKvHeads, cert::kDefaultDecodeBudget)};
  const std::int64_t page = r.config().page_size, pages = (n_ctx + page - 1) / page;
  std::vector<HeadPartial> merged(group), part;
  for (int s = 0; s < splits; ++s) {
    const std::int64_t b = std::min(n_ctx, pages * s / splits * page), e = std::min(n_ctx, pages * (s + 1) / splits * page);
    if (b >= e) continue;
    part.assign(group, HeadPartial{});
    kernel(r, q, group, d, b, e, ctx, part, meter);
    for (int h = 0; h < group; ++h) merged[h].merge(part[h]);
  }
  return merged;
}

// attend_partials finished: the output in out, the meters returned.
std::vector<HeadResult> attend(RangeKernel kernel, kvcache::KvStore::Reader& r, const float* q, int group, int d,
                               std::int64_t n_ctx, int splits, std::vector<float>& out, bool meter = true) {
  const std::vector<HeadPartial> merged = attend_partials(kernel, r, q, group, d, n_ctx, splits, meter);
  out.assign(static_cast<std::size_t>(group) * d, 0.0f);
  std::vector<HeadResult> res(group);
  // Values with their own dither take the value side's Tier B (its Σ p̃_t² ρ_t² compared too).
  const double delta_v = r.value_dither() ? cert::delta_loc(1e-2, 1, group * kKvHeads, cert::kDefaultDecodeBudget) : 0.0;
  for (int h = 0; h < group; ++h) res[h] = finish(merged[h], d, &out[h * d], cert::BoundShape::min, delta_v);
  return res;
}

// |a − b| ≤ tol·|b|, with equal infinities equal.
bool close(double a, double b, double tol) { return a == b || std::fabs(a - b) <= tol * std::fabs(b); }

// Whether the kernel decodes keys or values of format `name` with its own SIMD decoder
// (attention/cpu/packed-inl.h) and takes their logits in float.
bool packed(const std::string& name) {
  if (name == "fp16" || kvcache::dithered(name)) return false;  // the exact tier, and Tier B
  const formats::KvScheme& scheme = formats::kv_scheme(name);
  return scheme.tokens_per_block() == 1 && scheme.layout() != formats::PackedLayout::opaque;
}

// Fast against the reference on every format, page size, split count, GQA group and head
// dimension, with shuffled slots, on every SIMD target; and the fast meter against the true TV.
TEST(CertifiedFast, MatchesReferenceAndBoundsTrueTv) {
  const std::int64_t n = 77;  // a partial page and a partial group-scheme block at the end
  long cells = 0, violations = 0, runs = 0;
  double worst_out = 0.0, worst_meter = 0.0, worst_float_meter = 0.0;
  int config = 0;
  for (const Format& f : all_formats())
    for (int d : {64, 128})
      for (int page : {1, 16}) {
        Store s(f, d, n, page, 1000 + config);
        // Shared-page dither-int8 keys take float logits.
        const bool float_logits = kvcache::dithered(f.k) && f.dither != kvcache::DitherMode::per_slot;
        kvcache::KvStore::Reader r(s.store, 0, 1);
        for (int group : {1, 3, 7, 9}) {  // 9: more heads than one pass over the values takes
          const int splits = std::vector<int>{1, 2, 8}[(config + group) % 3];
          ++config;
          std::mt19937_64 rng(config);
          std::normal_distribution<float> g(0.0f, 1.5f);
          std::vector<float> q(static_cast<std::size_t>(group) * d);
          for (float& x : q) x = g(rng);
          const std::int64_t n_ctx = config % 2 ? n : 41;
          SCOPED_TRACE(testing::Message() << f.name() << " d " << d << " page " << page << " group " << group
                                          << " splits " << splits << " n_ctx " << n_ctx);
          std::vector<float> ref_out, out;
          const std::vector<HeadResult> ref = attend(reference_kernel, r, q.data(), group, d, n_ctx, splits, ref_out);
          std::vector<double> tv(group);
          for (int h = 0; h < group; ++h) tv[h] = true_tv(r, &q[h * d], d, 0, n_ctx);
          for_each_target([&](std::int64_t) {
            ++runs;
            const std::vector<HeadResult> fast = attend(attend_range_fast, r, q.data(), group, d, n_ctx, splits, out);
            for (int h = 0; h < group; ++h) {
              double scale = 0.0;
              for (int c = 0; c < d; ++c) scale = std::max(scale, std::fabs(double(ref_out[h * d + c])));
              for (int c = 0; c < d; ++c) {
                const double e = std::fabs(double(out[h * d + c]) - ref_out[h * d + c]);
                worst_out = std::max(worst_out, e / scale);
                ASSERT_LE(e, 1e-5 * scale) << "head " << h << " channel " << c;
              }
              for (const auto& [a, b, what] : {std::tuple{fast[h].eform_raw, ref[h].eform_raw, "eform_raw"},
                                               std::tuple{fast[h].meter, ref[h].meter, "meter"},
                                               std::tuple{fast[h].v_meter, ref[h].v_meter, "v_meter"}}) {
                if (float_logits) {
                  // Float logits: c_t carries the float rounding allowance η_t, about 1e-4 of the
                  // radius, and the float weights their allowance (cert::float_weight_error, about
                  // 1e-6), so the meters are a little looser than the reference's, never tighter.
                  // Below 8 bits c_t is 4–18× larger, and with it the moments' third-order excess
                  // (h(c_max) − ½)·c_max of log A (docs/tier-b.md): eform_raw, which the meter clips
                  // at 1, may exceed the reference's by up to 1 %.
                  const bool wide = std::string_view(what) == "eform_raw" && f.k != kvcache::kDitherInt8;
                  const double tol = std::string_view(what) == "v_meter" ? 1e-4 : wide ? 2e-2 : 3e-3;
                  if (a != b) worst_float_meter = std::max(worst_float_meter, std::fabs(a - b) / std::fabs(b));
                  ASSERT_TRUE(close(a, b, tol)) << what << " " << a << " vs " << b << ", head " << h;
                  ASSERT_GE(a, b * (1 - 1e-6)) << what << ", head " << h;
                } else {
                  if (a != b) worst_meter = std::max(worst_meter, std::fabs(a - b) / std::fabs(b));
                  ASSERT_TRUE(close(a, b, 1e-6)) << what << " " << a << " vs " << b << ", head " << h;
                }
              }
              ++cells;
              if (!(tv[h] <= fast[h].meter * (1 + 1e-9) + 1e-12)) {
                ++violations;
                ADD_FAILURE() << "TV " << tv[h] << " > meter " << fast[h].meter << ", head " << h;
              }
            }
          });
        }
      }
  std::printf("[certified-fast] %ld runs, %ld cells, %ld violations; worst |Δout|/max|out| %.2g, worst meter rel %.2g "
              "(float logits %.2g)\n",
              runs, cells, violations, worst_out, worst_meter, worst_float_meter);
  EXPECT_EQ(violations, 0);
}

// Keys rounded to nearest without dither (DitherMode::none, the evaluation's δ = 0 reference): the
// decode is s·round(k/s) on every non-outlier channel and the stored value on the outliers, the
// kernel serves them through the reference, and the deterministic bound holds on every head
// against the true TV under queries aligned with the rounding error of one token (the worst case
// of |q·(k − k̂)| ≤ Σ|q_c||k_c − k̂_c|), from small to saturated meters, for every bound shape.
TEST(RoundedKeys, DecodeToNearestAndBoundTheTrueTvUnderAlignedQueries) {
  long cells = 0;
  double tightest = 0.0;  // the largest TV / meter seen
  int config = 0;
  for (int d : {64, 128})
    for (int page : {1, 16})
      for (int m : {0, 4})
        for (std::int64_t n : {9, 41, 77}) {
          Format f{kvcache::kDitherInt8, n % 2 ? "fp16" : kvcache::kDitherInt8, kvcache::DitherMode::none};
          kvcache::CacheConfig c = Store::config(f, d, n, page, 300 + config);
          c.outlier_pairs = m;
          Store s(c, d, n, 300 + config++);
          kvcache::KvStore::Reader r(s.store, 0, 1);
          SCOPED_TRACE(testing::Message() << "d " << d << " page " << page << " m " << m << " n " << n);
          std::vector<float> k_hat(d), k(d), err(d);
          kvcache::KeyBound bound;
          for (std::int64_t t = 0; t < n; ++t) {
            r.key(t, k_hat.data(), bound);
            r.exact_key(t, k.data());
            if (bound.kind == kvcache::KeyBound::exact) continue;  // the calibration window
            ASSERT_EQ(bound.kind, kvcache::KeyBound::rounded);
            for (int ch = 0; ch < d; ++ch) {
              if (r.outlier_mask()[ch]) {
                ASSERT_EQ(k_hat[ch], k[ch]) << "outlier channel " << ch;
                continue;
              }
              const double sc = fp16_to_double(bound.scales[ch / formats::kDefaultGroup]);
              ASSERT_EQ(double(k_hat[ch]), static_cast<double>(static_cast<float>(sc * std::nearbyint(k[ch] / sc))))
                  << "token " << t << " channel " << ch;
              ASSERT_LE(std::fabs(double(k_hat[ch]) - k[ch]), sc * (0.5 + 0x1p-17));
            }
          }
          // Queries along the rounding error of the last token, at growing scales, plus noise.
          r.key(n - 1, k_hat.data(), bound);
          r.exact_key(n - 1, k.data());
          std::mt19937_64 rng(config);
          std::normal_distribution<float> g(0.0f, 0.05f);
          for (float scale : {0.5f, 4.0f, 40.0f, 400.0f}) {
            const int group = 3;
            std::vector<float> q(static_cast<std::size_t>(group) * d);
            for (int h = 0; h < group; ++h)
              for (int ch = 0; ch < d; ++ch) {
                const float e = k[ch] - k_hat[ch];
                q[h * d + ch] = scale * (h == 2 ? -1.0f : 1.0f) * (e > 0 ? 1.0f : e < 0 ? -1.0f : 0.0f) + g(rng);
              }
            std::vector<float> out, ref_out;
            const std::vector<HeadPartial> fast = attend_partials(attend_range_fast, r, q.data(), group, d, n, 2);
            const std::vector<HeadPartial> ref = attend_partials(reference_kernel, r, q.data(), group, d, n, 2);
            for (int h = 0; h < group; ++h) {
              const double tv = true_tv(r, &q[h * d], d, 0, n);
              for (cert::BoundShape shape : {cert::BoundShape::eform, cert::BoundShape::two_sided, cert::BoundShape::tanh,
                                             cert::BoundShape::tanh_half, cert::BoundShape::min}) {
                out.assign(d, 0.0f);
                ref_out.assign(d, 0.0f);
                const HeadResult a = finish(fast[h], d, out.data(), shape), b = finish(ref[h], d, ref_out.data(), shape);
                ASSERT_EQ(a.meter, b.meter) << cert::bound_shape_name(shape);
                ASSERT_EQ(out, ref_out);
                ++cells;
                ASSERT_LE(tv, a.meter * (1 + 1e-9) + 1e-12)
                    << "scale " << scale << " head " << h << " shape " << cert::bound_shape_name(shape);
                if (a.meter > 0) tightest = std::max(tightest, tv / a.meter);
              }
            }
          }
        }
  std::printf("[rounded-keys] %ld cells, largest TV/meter %.3f\n", cells, tightest);
  EXPECT_GT(cells, 0);
  EXPECT_GT(tightest, 0.05);  // the aligned queries come near the bound, not only below it
}

// The float tiles' moment sums (cert::MeterStats::add_moment) where c_t is far from small: queries
// scaled up until c_t reaches about 1, 30 and beyond e^c's double range (tiles above
// kFloatWeightMaxC take double weights). The risk score (eform_raw, unclamped) is never below the
// reference's, and its log A = ½·log(1 + 2·eform) within the float path's tolerance (relative to
// c_t: e^{2c} would amplify the allowance η_t by 2c); beyond the range both read +inf.
// Every Tier-A scheme on both sides, meter on, against the reference and the true TV, across page
// sizes 1, 16 and 64 and ranges under one page, over many pages and ending in a partial page, for
// GQA groups of 1, 3 and 9: the packed schemes through their SIMD decoders, the others through
// the black-box decode, all with the reference's meters up to the order of their double sums.
TEST(CertifiedFast, EveryTierAFormatMatchesReferenceAcrossPagesAndRanges) {
  const int d = 64;
  long cells = 0, violations = 0;
  double worst = 0.0;
  int config = 0;
  for (const std::string& name : formats::kv_scheme_names()) {
    if (name == "fp16") continue;  // the exact tier
    for (int page : {1, 16, 64}) {
      const std::int64_t n = 200;  // 200 = 3·64 + 8: a partial last page of 64
      Store s(Format{name, name}, d, n, page, 7000 + config);
      kvcache::KvStore::Reader r(s.store, 0, 0);
      for (const std::int64_t n_ctx : {std::int64_t{5}, std::int64_t{77}, n})
        for (int group : {1, 3, 9}) {
          ++config;
          std::mt19937_64 rng(config);
          std::normal_distribution<float> g(0.0f, 1.5f);
          std::vector<float> q(static_cast<std::size_t>(group) * d);
          for (float& x : q) x = g(rng);
          SCOPED_TRACE(testing::Message() << name << " page " << page << " n_ctx " << n_ctx << " group " << group);
          std::vector<float> ref_out, out;
          const std::vector<HeadResult> ref = attend(reference_kernel, r, q.data(), group, d, n_ctx, 1, ref_out);
          const std::vector<HeadResult> fast = attend(attend_range_fast, r, q.data(), group, d, n_ctx, 1, out);
          for (int h = 0; h < group; ++h) {
            double scale = 0.0;
            for (int c = 0; c < d; ++c) scale = std::max(scale, std::fabs(double(ref_out[h * d + c])));
            for (int c = 0; c < d; ++c) ASSERT_LE(std::fabs(double(out[h * d + c]) - ref_out[h * d + c]), 1e-5 * scale);
            for (const auto& [a, b] : {std::pair{fast[h].meter, ref[h].meter}, std::pair{fast[h].eform_raw, ref[h].eform_raw},
                                       std::pair{fast[h].v_meter, ref[h].v_meter}}) {
              ASSERT_TRUE(close(a, b, 1e-6)) << a << " vs " << b << ", head " << h;
              if (a != b) worst = std::max(worst, std::fabs(a - b) / std::fabs(b));
            }
            ++cells;
            const double tv = true_tv(r, &q[h * d], d, 0, n_ctx);
            if (!(tv <= fast[h].meter * (1 + 1e-9) + 1e-12)) {
              ++violations;
              ADD_FAILURE() << "TV " << tv << " > meter " << fast[h].meter << ", head " << h;
            }
          }
        }
    }
  }
  std::printf("[tier-a-formats] %ld cells, %ld violations; worst meter rel %.2g\n", cells, violations, worst);
  EXPECT_EQ(violations, 0);
}

TEST(CertifiedFast, FloatTilesWithLargeBoundsMatchReference) {
  const Format f{kvcache::kDitherInt8, kvcache::kDitherInt8, kvcache::DitherMode::shared_page};
  const std::int64_t n = 150;
  for (int d : {64, 128}) {
    Store s(f, d, n, 16, 77 + d);
    kvcache::KvStore::Reader r(s.store, 0, 1);
    const int group = 3;
    std::mt19937_64 rng(d);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> q0(static_cast<std::size_t>(group) * d), q(q0.size());
    for (float& x : q0) x = g(rng);
    for (float scale : {10.0f, 300.0f, 1e5f}) {
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = q0[i] * scale;
      SCOPED_TRACE(testing::Message() << "d " << d << " q scale " << scale);
      std::vector<float> ref_out, out;
      const std::vector<HeadResult> ref = attend(reference_kernel, r, q.data(), group, d, n, 2, ref_out);
      for_each_target([&](std::int64_t) {
        const std::vector<HeadResult> fast = attend(attend_range_fast, r, q.data(), group, d, n, 2, out);
        for (int h = 0; h < group; ++h) {
          const double a = fast[h].eform_raw, b = ref[h].eform_raw;
          if (scale > 1e4f) {
            EXPECT_EQ(b, INFINITY) << "head " << h;
          } else {
            EXPECT_GT(b, scale > 100.0f ? 1e6 : 0.1) << "head " << h;  // c_t is not small here
          }
          ASSERT_TRUE(close(0.5 * std::log1p(2 * a), 0.5 * std::log1p(2 * b), 3e-3)) << a << " vs " << b << ", head " << h;
          ASSERT_GE(a, b * (1 - 1e-6)) << "head " << h;
          ASSERT_GE(fast[h].meter, ref[h].meter * (1 - 1e-6)) << "head " << h;
        }
      });
    }
  }
}

// A float tile runs on across pages (ExtendTile) while it fills whole lane blocks: ranges that start
// and end inside pages, page sizes below, equal to and above a lane block, a promoted (exact) page
// and a prompt that ends inside a page to cut the tiles, each range against the reference.
TEST(CertifiedFast, TilesAcrossPagesMatchReference) {
  const int group = 3;
  const std::int64_t n = 150;
  int checked = 0;
  // Head dims and outlier pairs m: the scales (d/32 a token) and outlier values (2m) are split
  // into channels in registers for power-of-two counts up to 16 and gathered otherwise (d = 96,
  // m = 3).
  for (const auto& [d, m] : {std::pair{64, 4}, std::pair{96, 3}, std::pair{128, 8}, std::pair{64, 0}})
  for (const kvcache::DitherMode mode : {kvcache::DitherMode::shared_page, kvcache::DitherMode::shared_prompt})
    for (int page : {4, 8, 16, 32}) {
      const std::string fmt = page == 8 ? "dither-int6" : page == 32 ? "dither-int4" : kvcache::kDitherInt8;
      kvcache::CacheConfig c = Store::config({fmt, fmt, mode}, d, n, page, 77 + page);
      c.outlier_pairs = m;
      Store s(c, d, n, 77 + page);
      s.store.promote(0, 1, 64 / page + 1, n - 1);
      kvcache::KvStore::Reader r(s.store, 0, 1);
      std::mt19937_64 rng(page);
      std::normal_distribution<float> g(0.0f, 1.5f);
      std::vector<float> q(static_cast<std::size_t>(group) * d);
      for (float& x : q) x = g(rng);
      const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), n, 1e-4};
      for (const auto& [b, e] : {std::pair<std::int64_t, std::int64_t>{0, n}, {5, 150}, {8, 121}, {13, 99}, {17, 18}, {40, 88}, {48, 130}}) {
        std::vector<HeadPartial> ref(group), fast;
        attend_range_reference(r, q.data(), group, d, b, e, ctx, ref);
        for_each_target([&](std::int64_t) {
          fast.assign(group, HeadPartial{});
          attend_range_fast(r, q.data(), group, d, b, e, ctx, fast, true);
          for (int h = 0; h < group; ++h) {
            SCOPED_TRACE(testing::Message() << "d " << d << " m " << m << " page " << page << " range [" << b << ", " << e << ") head " << h);
            std::vector<float> want(d), got(d);
            const HeadResult rr = finish(ref[h], d, want.data()), rf = finish(fast[h], d, got.data());
            double scale = 0.0;
            for (int c = 0; c < d; ++c) scale = std::max(scale, std::fabs(double(want[c])));
            for (int c = 0; c < d; ++c) ASSERT_LE(std::fabs(double(got[c]) - want[c]), 1e-5 * scale) << "channel " << c;
            // The float path's allowance η_t grows with its rounding count, 2m + d/32 + 2 for an
            // outlier term (certified_attention_fast.cc): looser for many outlier pairs, and an
            // absolute 1e-5 where the meter itself is tiny (d 128, m 8: 4.46e-5 against 4.34e-5,
            // the same before the scales and outlier values were split in registers).
            const double tolerance = 3e-3 * std::max(1.0, (2.0 * m + d / 32 + 2) / 16.0);
            ASSERT_LE(std::fabs(rf.meter - rr.meter), tolerance * rr.meter + 1e-5) << rf.meter << " vs " << rr.meter;
            ASSERT_GE(rf.meter, rr.meter * (1 - 1e-6));
            ASSERT_EQ(fast[h].meter.n, ref[h].meter.n);
            ++checked;
          }
        });
      }
    }
  EXPECT_GT(checked, 0);
}

// NaN or Inf in the query or in a stored key gives meter 1 and raw +inf, never a finite meter.
TEST(CertifiedFast, NonFiniteQueryOrKeyMeansNoGuarantee) {
  const int d = 64, group = 3;
  const std::int64_t n = 40;
  for (const char* fmt : {"rtn-int8", "q8_0", "kivi-2bit", "fp8-e4m3", kvcache::kDitherInt8}) {
    for (const bool shared : {false, true}) {
      Format f{fmt, "q8_0", shared ? kvcache::DitherMode::shared_page : kvcache::DitherMode::per_slot};
      for (const float bad : {NAN, INFINITY, -INFINITY}) {
        for (const bool in_key : {false, true}) {
          kvcache::CacheConfig cfg = Store::config(f, d, n, 16, 5);
          kvcache::KvStore store(cfg);
          std::mt19937_64 rng(7);
          std::normal_distribution<float> g(0.0f, 1.0f);
          std::vector<float> k(d), v(d);
          for (std::int64_t p = 0; p < n; ++p)
            for (int h = 0; h < kKvHeads; ++h) {
              for (int c = 0; c < d; ++c) k[c] = g(rng), v[c] = g(rng);
              if (in_key && p == 20) k[9] = bad;
              store.write(0, h, p, k.data(), v.data());
            }
          std::vector<float> q(group * d, 0.2f), out;
          if (!in_key) q[d + 5] = bad;  // query head 1 only
          kvcache::KvStore::Reader r(store, 0, 1);
          for_each_target([&](std::int64_t) {
            for (int splits : {1, 2}) {
              const std::vector<HeadResult> res = attend(attend_range_fast, r, q.data(), group, d, n, splits, out);
              for (int h = 0; h < group; ++h) {
                if (!in_key && h != 1) continue;
                SCOPED_TRACE(testing::Message() << f.name() << " bad " << bad << (in_key ? " in key" : " in query")
                                                << " head " << h);
                EXPECT_EQ(res[h].meter, 1.0);
                EXPECT_EQ(res[h].eform_raw, INFINITY);
              }
            }
          });
        }
      }
    }
  }
}

// A query head that falls back to the token-by-token path (here: NaN in the last head) leaves
// the other heads' outputs and value-side terms as the reference computes them, on every format
// and target (the fast path takes max_t(‖v̂_t‖ + ρ_t) of a tile once its other heads are done).
TEST(CertifiedFast, ScalarHeadLeavesTheOtherHeads) {
  const int d = 64, group = 3;
  const std::int64_t n = 100;
  for (const Format& f : all_formats()) {
    Store s(f, d, n, 16, 11);
    kvcache::KvStore::Reader r(s.store, 0, 0);
    std::vector<float> q(group * d, 0.1f), ref_out, out;
    for (int c = 0; c < group * d; ++c) q[c] = 0.05f * static_cast<float>((c * 7) % 11) - 0.2f;
    q[(group - 1) * d + 3] = NAN;
    const std::vector<HeadResult> ref = attend(reference_kernel, r, q.data(), group, d, n, 1, ref_out);
    for_each_target([&](std::int64_t) {
      const std::vector<HeadResult> fast = attend(attend_range_fast, r, q.data(), group, d, n, 1, out);
      for (int h = 0; h + 1 < group; ++h) {
        for (int c = 0; c < d; ++c)
          ASSERT_NEAR(out[h * d + c], ref_out[h * d + c], 1e-5 * (1.0 + std::fabs(ref_out[h * d + c])))
              << f.name() << " head " << h << " channel " << c;
        ASSERT_TRUE(close(fast[h].v_meter, ref[h].v_meter, 1e-4)) << f.name() << " head " << h << ": "
                                                                  << fast[h].v_meter << " vs " << ref[h].v_meter;
        ASSERT_GE(fast[h].output_bound, ref[h].output_bound * (1 - 1e-9)) << f.name() << " head " << h;
      }
    });
  }
}

// dither-int8 values keep each page's max_t (‖v̂_t‖ + ρ_t) (KvStore); the kernel takes it for a
// tile that holds every packed token of its pages and computes the norms otherwise. Ranges that end
// inside a page whose later tokens are 100× larger, every split of the range, and pages reused
// after clear() by smaller values all give the reference's v_max (up to the stored float's
// rounding up, 2^-23), never less.
TEST(CertifiedFast, StoredValueNormsMatchTheReference) {
  const int d = 64, group = 3;
  const std::int64_t n = 128;
  for (const std::string& fmt : kvcache::dither_format_names())
  for (const int page : {1, 16})
    for (const kvcache::DitherMode mode : {kvcache::DitherMode::per_slot, kvcache::DitherMode::shared_page}) {
      SCOPED_TRACE(fmt + " page " + std::to_string(page));
      kvcache::KvStore store(Store::config(Format{fmt, fmt, mode}, d, n, page, 5));
      std::mt19937_64 rng(9);
      std::normal_distribution<float> g(0.0f, 1.0f);
      std::vector<float> q(group * d), k(d), v(d);
      for (float& x : q) x = 0.3f * g(rng);
      for (const float big : {100.0f, 1.0f}) {  // the second fill reuses every page, with smaller values
        store.clear();
        for (std::int64_t p = 0; p < n; ++p)
          for (int h = 0; h < kKvHeads; ++h) {
            for (int c = 0; c < d; ++c) {
              k[c] = g(rng);
              v[c] = g(rng) * (p % 16 == 13 ? big : 1.0f);
            }
            store.write(0, h, p, k.data(), v.data());
          }
        kvcache::KvStore::Reader r(store, 0, 0);
        for (const std::int64_t e : {1, 13, 14, 16, 17, 45, 46, 64, 100, 128})
          for (const int splits : {1, 2, 8}) {
            const std::vector<HeadPartial> ref = attend_partials(reference_kernel, r, q.data(), group, d, e, splits);
            for_each_target([&](std::int64_t) {
              const std::vector<HeadPartial> fast = attend_partials(attend_range_fast, r, q.data(), group, d, e, splits);
              for (int h = 0; h < group; ++h) {
                ASSERT_GE(fast[h].v_max, ref[h].v_max * (1 - 1e-12)) << "page " << page << " e " << e << " splits " << splits;
                ASSERT_LE(fast[h].v_max, ref[h].v_max * (1 + 0x1p-22)) << "page " << page << " e " << e << " splits " << splits
                                                                       << " big " << big;
              }
            });
          }
      }
    }
}

// The meter switch of the benchmarks changes nothing but the meter (which it leaves out whole,
// the value side included), on every target and on the float path of shared-ξ keys.
TEST(CertifiedFast, MeterOffLeavesTheOutput) {
  for (const Format& f : {Format{"rtn-int8", "rtn-int8"}, Format{kvcache::kDitherInt8, kvcache::kDitherInt8},
                          Format{kvcache::kDitherInt8, kvcache::kDitherInt8, kvcache::DitherMode::shared_page},
                          Format{"dither-int5", "dither-int4", kvcache::DitherMode::shared_page}})
    for (const auto& [d, group] : {std::pair{64, 3}, std::pair{128, 7}}) {
      Store s(f, d, 200, 16, 3);
      kvcache::KvStore::Reader r(s.store, 0, 0);
      std::vector<float> q(group * d), on, off;
      for (int c = 0; c < group * d; ++c) q[c] = 0.05f * static_cast<float>((c * 7) % 11) - 0.2f;
      for_each_target([&](std::int64_t) {
        const std::vector<HeadResult> metered = attend(attend_range_fast, r, q.data(), group, d, 200, 2, on);
        attend(attend_range_fast, r, q.data(), group, d, 200, 2, off, false);
        EXPECT_EQ(on, off) << f.name() << " d " << d;
        for (const HeadResult& res : metered) EXPECT_GT(res.v_meter, 0.0) << f.name() << " d " << d;
      });
    }
}

// The vectorized Philox against formats::dither_values (itself checked against Random123's
// known answers in philox_test.cc), bit for bit.
TEST(CertifiedFast, DitherMatchesScalarPhilox) {
  for_each_target([](std::int64_t) {
    for (const formats::DitherStream s : {formats::DitherStream{0, 0, 0}, formats::DitherStream{0x5EED, 3, 1},
                                        formats::DitherStream{0xFFFFFFFFFFFFFFFFull, 29, 7}})
      for (std::uint32_t counter : {0u, 1u, 17u, 0x7FFFFFFFu, 0x80000003u, 0xFFFFFFFFu})
        for (int d : {4, 32, 64, 128, 256}) {
          std::vector<float> want(d), got(d);
          formats::dither_values(s, counter, want);
          dither_values_fast(s, counter, got);
          ASSERT_EQ(got, want) << "counter " << counter << " d " << d;
        }
  });
}

// The kernel evaluates u_t as sqrt(ς_t²)·κ with κ = subgaussian_radius(1, ·): the same function
// as subgaussian_radius(ς_t², ·) up to the rounding of one product.
// The kernel's SIMD decoders give the floats of the scheme's own decode, bit for bit, on every
// target: tokens of varied scale with zeros, values that round to the extremes of the codes, and
// non-finite values (which poison their group or token).
TEST(CertifiedFast, PackedDecodersMatchSchemeDecode) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  int schemes = 0;
  for (const std::string& name : formats::kv_scheme_names())
    for (const formats::KvSide side : {formats::KvSide::key, formats::KvSide::value}) {
      const formats::KvScheme& scheme = formats::kv_scheme(name, side);
      if (scheme.layout() == formats::PackedLayout::opaque) continue;
      ++schemes;
      for (int d : {32, 64, 128})
        for (int trial = 0; trial < 20; ++trial) {
          std::vector<float> x(d);
          const float scale = std::ldexp(1.0f, trial - 10);
          for (float& v : x) v = scale * g(rng) * (trial % 3 == 0 ? 100.0f : 1.0f);
          if (trial % 5 == 1) x[d / 2] = 0.0f, x[0] = -x[1];
          if (trial == 7) x[3] = NAN;
          if (trial == 8) x[d - 1] = INFINITY;
          std::vector<std::uint8_t> packed(scheme.block_bytes(d));
          scheme.encode(x.data(), d, packed.data());
          std::vector<float> want(d), got(d);
          scheme.decode(packed.data(), d, want.data());
          for_each_target([&](std::int64_t) {
            std::fill(got.begin(), got.end(), 0.0f);
            decode_packed_row(scheme.layout(), packed.data(), d, got.data());
            for (int c = 0; c < d; ++c)
              ASSERT_EQ(std::bit_cast<std::uint32_t>(got[c]), std::bit_cast<std::uint32_t>(want[c]))
                  << name << " d " << d << " trial " << trial << " channel " << c << ": " << got[c] << " vs " << want[c];
          });
        }
    }
  EXPECT_GE(schemes, 20);  // fp16, fp8-e4m3 (and scaled), rtn-int8/int4, q8_0, q4_0/1, q5_0/1, iq4_nl, both sides
}

// The kernel unpacks dithered codes below 8 bits as formats::unpack_codes does, on every target:
// every code value at every position of a block, over runs of 1 to 64 blocks.
TEST(CertifiedFast, PackedCodesUnpackAsTheScalarReference) {
  std::mt19937_64 rng(12);
  for (int bits : {4, 5, 6}) {
    const int q = formats::dither_max_code(bits);
    for (std::size_t blocks : {1u, 2u, 7u, 64u}) {
      const std::size_t n = blocks * formats::kCodeBlock;
      std::vector<std::uint8_t> run(formats::packed_code_bytes(n, bits));
      for (std::size_t i = 0; i < n; ++i)  // each value at each block position across the blocks
        formats::pack_code(run.data(), i, bits,
                           static_cast<std::int8_t>((static_cast<int>(i / formats::kCodeBlock + i) + static_cast<int>(rng() % 3)) %
                                                        (2 * q + 1) - q));
      std::vector<std::int8_t> want(n), got(n);
      formats::unpack_codes(run.data(), bits, n, want.data());
      for_each_target([&](std::int64_t) {
        std::fill(got.begin(), got.end(), 0);
        unpack_codes_fast(run.data(), bits, n, got.data());
        ASSERT_EQ(got, want) << bits << " bits, " << blocks << " blocks";
      });
    }
  }
}

// The code-book decoders (fp8 by arithmetic, iq4_nl by byte shuffle) on every code they can
// read, under scales that are zero, subnormal, ordinary, the largest fp16 and infinite, against the
// scheme's own decode, bit for bit (NaN payloads and signed zeros included).
TEST(CertifiedFast, CodeBookDecodersMatchOnEveryCode) {
  const std::vector<f16> scales = {0x0000, 0x8000, 0x0001, 0x03FF, 0x3C00, 0xB555, 0x7BFF, 0x7C00};
  for (const char* name : {"fp8-e4m3", "fp8-e4m3-scaled", "iq4_nl"}) {
    const formats::KvScheme& scheme = formats::kv_scheme(name, formats::KvSide::key);
    const bool fp8 = std::string_view(name) != "iq4_nl";
    const int d = 256;  // fp8: code c at channel c; iq4_nl: 8 records, every nibble in both halves
    for (f16 scale : scales) {
      std::vector<std::uint8_t> packed(scheme.block_bytes(d));
      if (std::string_view(name) == "fp8-e4m3") {
        if (scale != scales.front()) continue;  // no scale
        for (int c = 0; c < d; ++c) packed[c] = static_cast<std::uint8_t>(c);
      } else if (fp8) {
        std::memcpy(packed.data(), &scale, 2);
        for (int c = 0; c < d; ++c) packed[2 + c] = static_cast<std::uint8_t>(c);
      } else {
        for (int g = 0; g < d / 32; ++g) {
          std::uint8_t* r = packed.data() + g * 18;
          std::memcpy(r, &scale, 2);
          for (int j = 0; j < 16; ++j) r[2 + j] = static_cast<std::uint8_t>((j + g) % 16 | ((15 - j + 3 * g) % 16) << 4);
        }
      }
      std::vector<float> want(d), got(d);
      scheme.decode(packed.data(), d, want.data());
      for_each_target([&](std::int64_t) {
        std::fill(got.begin(), got.end(), 1.0f);
        decode_packed_row(scheme.layout(), packed.data(), d, got.data());
        for (int c = 0; c < d; ++c)
          ASSERT_EQ(std::bit_cast<std::uint32_t>(got[c]), std::bit_cast<std::uint32_t>(want[c]))
              << name << " scale " << scale << " channel " << c << ": " << got[c] << " vs " << want[c];
      });
    }
  }
}

TEST(CertifiedFast, HoistedRadiusIsTheSubgaussianRadius) {
  for (long S : {1L, 77L, 32768L})
    for (double delta : {1e-2, 1e-9})
      for (int D : {24, 56, 120})
        for (double v2 = 1e-12; v2 < 1e6; v2 *= 3.7) {
          const double kappa = cert::subgaussian_radius(1.0, S, delta, D);
          const double want = cert::subgaussian_radius(v2, S, delta, D);
          EXPECT_NEAR(std::sqrt(v2) * kappa, want, 4 * 0x1p-52 * want);
        }
}

// Whether the registry scheme `name` allocates to decode a token on either side (dithered formats:
// no scheme).
bool decode_allocates(const std::string& name) {
  if (kvcache::dithered(name)) return false;
  for (const formats::KvSide side : {formats::KvSide::key, formats::KvSide::value}) {
    const formats::KvScheme& scheme = formats::kv_scheme(name, side);
    const int d = 64;
    std::vector<float> x(static_cast<std::size_t>(scheme.tokens_per_block()) * d, 0.5f), out(x.size());
    std::vector<std::uint8_t> packed(scheme.block_bytes(d));
    scheme.encode(x.data(), d, packed.data());
    const long before = testing_util::thread_allocations();
    scheme.decode(packed.data(), d, out.data());
    if (testing_util::thread_allocations() != before) return true;
  }
  return false;
}

// The workspace is the kernel's only memory: once it and the partials have served a call, calls of
// any format (double and float paths, per-token and group schemes), meter on or off, on every
// SIMD target, allocate nothing.
TEST(CertifiedFast, NoAllocationsOnceWarm) {
  const int d = 64, group = 3;
  const std::int64_t n = 300;
  for (const Format& f : all_formats()) {
    // Some research schemes' black-box decoders allocate inside formats::KvScheme::decode: not the
    // kernel's allocations, so the formats that take one are left out (packed ones never call it).
    if ((!packed(f.k) && decode_allocates(f.k)) || (!packed(f.v) && decode_allocates(f.v))) continue;
    Store s(f, d, n, 16, 5);
    kvcache::KvStore::Reader r(s.store, 0, 0);
    for_each_target([&](std::int64_t) { expect_warm_attend_allocates_nothing(r, group, d, n, f.name()); });
  }
}

}  // namespace
}  // namespace witcert::kernel
