// The SIMD decoders of kivi-2bit, kvquant-4, rot-4bit, rtn-2bit and sign-1bit (packed-inl.h,
// group-inl.h, rotation-inl.h): bit for bit formats::KvScheme::decode on every target, and the
// kernel that reads them against the scalar reference (attention::attend_range_reference) and the true
// TV, as keys and as values, with no allocation once warm.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu/attend.h"
#include "attention/cpu/warm_attend_check.h"
#include "attention/reference/certified_attention.h"
#include "base/alloc_counter.h"
#include "cert/subgaussian.h"
#include "formats/schemes.h"
#include "kvcache/test_config.h"

namespace witcert::kernel {
namespace {

using namespace witcert::attention;

const char* const kFormats[] = {"kivi-2bit", "kvquant-4", "rot-4bit", "rtn-2bit", "sign-1bit"};

// Runs fn once per SIMD target compiled in and supported by this CPU, each forced in turn.
template <class Fn>
void for_each_target(Fn fn) {
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    fn();
  }
  hwy::SetSupportedTargetsForTest(0);
}

bool same_bits(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

// T tokens of d values: Gaussian at a scale that sweeps the fp16 range with the trial, some zeros,
// a massive channel or a massive entry (kvquant-4's sparse outliers), a non-finite value.
std::vector<float> block_values(int T, int d, int trial, std::mt19937_64& rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(T) * d);
  const float scale = std::ldexp(1.0f, trial % 21 - 12);
  for (float& v : x) v = scale * g(rng);
  if (trial % 4 == 1)
    for (int t = 0; t < T; ++t) x[t * d + 3] *= 300.0f;  // a massive channel
  if (trial % 4 == 2) x[(T / 2) * d + d / 2] = scale * 4000.0f;  // a massive entry
  if (trial % 5 == 3) x[d - 1] = 0.0f, x[0] = -x[1];
  if (trial == 7) x[x.size() / 3] = NAN;
  if (trial == 11) x[static_cast<std::size_t>(T - 1) * d] = -INFINITY;
  return x;
}

// Every run of tokens of a group scheme's block, on every target, against decode's rows.
TEST(TierADecoders, GroupKeysMatchSchemeDecodeOnEveryRun) {
  std::mt19937_64 rng(11);
  int checked = 0;
  for (const char* name : {"kivi-2bit", "kvquant-4"}) {
    const formats::KvScheme& scheme = formats::kv_scheme(name, formats::KvSide::key);
    ASSERT_NE(scheme.group_layout(), formats::GroupLayout::opaque) << name;
    const int T = scheme.tokens_per_block();
    for (int d : {32, 64, 96, 128})
      for (int trial = 0; trial < 14; ++trial) {
        const std::vector<float> x = block_values(T, d, trial, rng);
        std::vector<std::uint8_t> packed(scheme.block_bytes(d));
        scheme.encode(x.data(), d, packed.data());
        std::vector<float> want(x.size()), got(x.size());
        scheme.decode(packed.data(), d, want.data());
        for_each_target([&] {
          for (const auto& [first, count] : {std::pair{0, 32}, std::pair{0, 1}, std::pair{5, 11}, std::pair{16, 16}, std::pair{31, 1}}) {
            std::fill(got.begin(), got.end(), 0.0f);
            decode_group_rows(scheme.group_layout(), packed.data(), d, first, count, got.data());
            for (int i = 0; i < count * d; ++i)
              ASSERT_TRUE(same_bits(got[i], want[first * d + i]))
                  << name << " d " << d << " trial " << trial << " tokens [" << first << ", " << first + count << ") token "
                  << first + i / d << " channel " << i % d << ": " << got[i] << " vs " << want[first * d + i];
            ++checked;
          }
        });
      }
  }
  EXPECT_GT(checked, 0);
}

// The per-token layouts at head dims the registry test does not reach: rot-4bit up to the
// decoder's largest d (32 scale groups, the double path) and kvquant-4 values with several
// outliers and an odd d (a scalar tail).
TEST(TierADecoders, PerTokenDecodersMatchSchemeDecodeAtEveryHeadDim) {
  std::mt19937_64 rng(12);
  int checked = 0;
  const std::pair<const char*, std::vector<int>> cases[] = {
      {"rot-4bit", {32, 64, 128, 256, 512, 1024}},
      {"kvquant-4", {7, 37, 64, 200, 333}},
      {"rtn-2bit", {32, 96, 256}},
      {"sign-1bit", {32, 96, 256}},
      {"kivi-2bit", {32, 96, 256}}};
  for (const auto& [name, dims] : cases) {
    const formats::KvScheme& scheme = formats::kv_scheme(name, formats::KvSide::value);
    ASSERT_EQ(scheme.tokens_per_block(), 1) << name;
    ASSERT_NE(scheme.layout(), formats::PackedLayout::opaque) << name;
    for (int d : dims)
      for (int trial = 0; trial < 14; ++trial) {
        const std::vector<float> x = block_values(1, d, trial, rng);
        std::vector<std::uint8_t> packed(scheme.block_bytes(d));
        scheme.encode(x.data(), d, packed.data());
        std::vector<float> want(d), got(d);
        scheme.decode(packed.data(), d, want.data());
        for_each_target([&] {
          std::fill(got.begin(), got.end(), 0.0f);
          decode_packed_row(scheme.layout(), packed.data(), d, got.data());
          for (int c = 0; c < d; ++c)
            ASSERT_TRUE(same_bits(got[c], want[c]))
                << name << " d " << d << " trial " << trial << " channel " << c << ": " << got[c] << " vs " << want[c];
          ++checked;
        });
      }
  }
  EXPECT_GT(checked, 0);
}

// A store of one layer and two KV heads: keys with a spread of channel gains, and with
// `outliers` a pair of massive channels and a few massive single entries; values of varied norms.
std::unique_ptr<kvcache::KvStore> filled_store(const std::string& k, const std::string& v, int d, std::int64_t n, int page,
                                             bool outliers, std::uint64_t seed) {
  kvcache::CacheConfig c = kvcache::test_config(1, 2, d, n, page, k, v, seed);
  c.exact_tier = true;  // the true TV reads it
  c.backing = kvcache::BackingPlace::in_ram();
  auto store = std::make_unique<kvcache::KvStore>(c);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> gain(d), key(d), value(d);
  for (float& x : gain) x = std::exp(0.5f * g(rng));
  if (outliers) gain[6] = gain[7] = 12.0f;
  for (std::int64_t p = 0; p < n; ++p)
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < d; ++i) {
        key[i] = gain[i] * g(rng);
        value[i] = g(rng) * (1.0f + static_cast<float>(p % 3));
      }
      if (outliers && p % 37 == 5) key[(p * 7) % d] *= 60.0f, value[(p * 11) % d] *= 40.0f;
      store->write(0, h, p, key.data(), value.data());
    }
  return store;
}

// Each format as keys (fp16 values), as values (fp16 keys) and on both sides, over short and long
// ranges that start and end inside blocks, pages and tiles, page sizes 1 to 64, with and without
// outliers, GQA groups 1 and 3, on every target: the output within 1e-5 of the reference's scale
// and the meters within 1e-6 (the order of their double sums), as for every other Tier-A format,
// and the meter never below the true TV.
TEST(TierADecoders, KernelMatchesReferenceAsKeysAndValues) {
  long cells = 0, violations = 0;
  double worst_out = 0.0, worst_meter = 0.0;
  int config = 0;
  for (const char* name : kFormats)
    for (const auto& [k, v] : {std::pair<std::string, std::string>{name, "fp16"}, {"fp16", name}, {name, name}})
      for (const int page : {1, 16, 64})
        for (const bool outliers : {false, true}) {
          const int d = config % 3 == 0 ? 128 : 64;
          const std::int64_t n = 333;  // 2 tiles and a partial one, 10 blocks and a partial one
          const auto store = filled_store(k, v, d, n, page, outliers, 500 + config);
          kvcache::KvStore::Reader r(*store, 0, 1);
          for (const auto& [b, e] : {std::pair<std::int64_t, std::int64_t>{0, n}, {0, 7}, {5, 150}, {33, 34}, {31, 290}, {96, 330}}) {
            const int group = ++config % 2 ? 3 : 1;
            std::mt19937_64 rng(config);
            std::normal_distribution<float> g(0.0f, 1.5f);
            std::vector<float> q(static_cast<std::size_t>(group) * d);
            for (float& x : q) x = g(rng);
            // The range is the last of a context that ends at e: split-KV's last part.
            const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), e, cert::delta_loc(1e-2, 1, 2 * group, cert::kDefaultDecodeBudget)};
            SCOPED_TRACE(testing::Message() << k << "/" << v << " d " << d << " page " << page << " outliers " << outliers
                                            << " range [" << b << ", " << e << ") group " << group);
            std::vector<HeadPartial> ref(group), fast;
            attend_range_reference(r, q.data(), group, d, b, e, ctx, ref);
            std::vector<float> want(d), got(d);
            std::vector<HeadResult> ref_res(group);
            std::vector<std::vector<float>> ref_out(group, std::vector<float>(d));
            for (int h = 0; h < group; ++h) ref_res[h] = finish(ref[h], d, ref_out[h].data());
            // The true TV of the whole context [0, e) bounds the merged meter; for [b, e) alone it
            // is the TV over those tokens.
            std::vector<double> tv(group, -1.0);
            if (b == 0)
              for (int h = 0; h < group; ++h) tv[h] = true_tv(r, &q[h * d], d, 0, e);
            for_each_target([&] {
              static Workspace work;  // one for all: a workspace left by other formats serves as a fresh one
              fast.assign(group, HeadPartial{});
              attend_range(work, r, q.data(), group, d, b, e, ctx, fast);
              for (int h = 0; h < group; ++h) {
                const HeadResult res = finish(fast[h], d, got.data());
                double scale = 0.0;
                for (int c = 0; c < d; ++c) scale = std::max(scale, std::fabs(double(ref_out[h][c])));
                for (int c = 0; c < d; ++c) {
                  const double err = std::fabs(double(got[c]) - ref_out[h][c]);
                  worst_out = std::max(worst_out, err / scale);
                  ASSERT_LE(err, 1e-5 * scale) << "head " << h << " channel " << c;
                }
                for (const auto& [a, want_m, what] : {std::tuple{res.meter, ref_res[h].meter, "meter"},
                                                      std::tuple{res.eform_raw, ref_res[h].eform_raw, "eform_raw"},
                                                      std::tuple{res.v_meter, ref_res[h].v_meter, "v_meter"}}) {
                  if (a != want_m) worst_meter = std::max(worst_meter, std::fabs(a - want_m) / std::fabs(want_m));
                  ASSERT_TRUE(a == want_m || std::fabs(a - want_m) <= 1e-6 * std::fabs(want_m))
                      << what << " " << a << " vs " << want_m << ", head " << h;
                }
                ++cells;
                if (tv[h] >= 0.0 && !(tv[h] <= res.meter * (1 + 1e-9) + 1e-12)) {
                  ++violations;
                  ADD_FAILURE() << "TV " << tv[h] << " > meter " << res.meter << ", head " << h;
                }
              }
            });
          }
        }
  std::printf("[tier-a-decoders] %ld cells, %ld violations; worst |Δout|/max|out| %.2g, worst meter rel %.2g\n", cells,
              violations, worst_out, worst_meter);
  EXPECT_EQ(violations, 0);
}

// Once warm, the kernel allocates nothing for these formats on either side, meter on or off, on
// every target. Each has a SIMD layout, which is what the kernel dispatches on (checked first), and
// KernelMatchesReferenceAsKeysAndValues shows the SIMD decoders give the black-box decode's floats.
TEST(TierADecoders, NoAllocationsOnceWarm) {
  const int d = 64, group = 3;
  const std::int64_t n = 300;
  for (const char* name : kFormats) {
    for (const formats::KvSide side : {formats::KvSide::key, formats::KvSide::value}) {
      const formats::KvScheme& scheme = formats::kv_scheme(name, side);
      ASSERT_TRUE(scheme.layout() != formats::PackedLayout::opaque || scheme.group_layout() != formats::GroupLayout::opaque)
          << name << ": no SIMD decoder";
    }
    for (const auto& [k, v] : {std::pair<std::string, std::string>{name, name}, {name, "fp16"}, {"fp16", name}}) {
      const auto store = filled_store(k, v, d, n, 16, true, 9);
      kvcache::KvStore::Reader r(*store, 0, 0);
      for_each_target([&] { expect_warm_attend_allocates_nothing(r, group, d, n, k + "/" + v); });
    }
  }
}

}  // namespace
}  // namespace witcert::kernel
