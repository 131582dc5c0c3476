// The C API's batched entry points against its one-row calls: the same bits for every row, dtype
// and thread count; bad rows refused with the row named; attention over a range against the exact
// attention over that range; and the report, the server's `witcert` object.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "base/fp16.h"
#include "witcert/witcert.h"

namespace {

using namespace witcert;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool same(const witcert_bounds& a, const witcert_bounds& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

std::uint16_t bf16_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return static_cast<std::uint16_t>(u >> 16);  // truncation: the value the test then widens is the array's
}

double bf16_value(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rows of random logits (a few masked) and bounds, and of probabilities.
struct Rows {
  std::vector<double> z, c, p;
};

Rows random_rows(std::size_t rows, std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 3.0);
  std::exponential_distribution<double> ex(20.0);
  Rows r;
  r.z.resize(rows * n), r.c.resize(rows * n), r.p.resize(rows * n);
  for (std::size_t i = 0; i < rows * n; ++i) {
    r.z[i] = (n > 1 && i % n == n / 2 && i % 3 == 0) ? -HUGE_VAL : nd(rng);
    r.c[i] = ex(rng);
  }
  for (std::size_t row = 0; row < rows; ++row) {
    double mx = -HUGE_VAL, total = 0;
    for (std::size_t t = 0; t < n; ++t) mx = std::max(mx, r.z[row * n + t]);
    for (std::size_t t = 0; t < n; ++t) total += r.p[row * n + t] = std::exp(r.z[row * n + t] - mx);
    for (std::size_t t = 0; t < n; ++t) r.p[row * n + t] /= total;
  }
  return r;
}

TEST(CApiBatch, TheMeterOfEveryRowIsItsOwnCallBitForBit) {
  for (std::size_t n : {1, 3, 64, 1000})
    for (std::size_t rows : {1, 7, 300}) {
      SCOPED_TRACE("n " + std::to_string(n) + " rows " + std::to_string(rows));
      const Rows r = random_rows(rows, n, static_cast<unsigned>(n * 1000 + rows));
      for (int threads : {1, 2, 0}) {
        std::vector<witcert_bounds> zl(rows), pl(rows);
        ASSERT_EQ(witcert_meter_logits_batch(r.z.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, rows, n,
                                             threads, zl.data()),
                  WITCERT_OK)
            << witcert_last_error();
        ASSERT_EQ(witcert_meter_probs_batch(r.p.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, rows, n,
                                            threads, pl.data()),
                  WITCERT_OK)
            << witcert_last_error();
        for (std::size_t row = 0; row < rows; ++row) {
          witcert_bounds one{}, one_p{};
          ASSERT_EQ(witcert_meter_logits(r.z.data() + row * n, r.c.data() + row * n, n, &one), WITCERT_OK);
          ASSERT_EQ(witcert_meter_probs(r.p.data() + row * n, r.c.data() + row * n, n, &one_p), WITCERT_OK);
          EXPECT_TRUE(same(zl[row], one)) << "row " << row << " threads " << threads;
          EXPECT_TRUE(same(pl[row], one_p)) << "row " << row << " threads " << threads;
        }
      }
    }
}

TEST(CApiBatch, EveryDtypeIsWidenedExactly) {
  const std::size_t rows = 5, n = 48;
  const Rows r = random_rows(rows, n, 3);
  std::vector<float> z32(rows * n), c32(rows * n);
  std::vector<std::uint16_t> z16(rows * n), c16(rows * n), zb(rows * n), cb(rows * n);
  for (std::size_t i = 0; i < rows * n; ++i) {
    z32[i] = static_cast<float>(r.z[i]), c32[i] = static_cast<float>(r.c[i]);
    z16[i] = fp16_from_double(r.z[i]), c16[i] = fp16_from_double(r.c[i]);
    zb[i] = bf16_bits(z32[i]), cb[i] = bf16_bits(c32[i]);
  }
  struct Case {
    const void* z;
    const void* c;
    witcert_dtype type;
    double (*value)(const void*, std::size_t);
  };
  const Case cases[] = {
      {z32.data(), c32.data(), WITCERT_DTYPE_F32,
       [](const void* p, std::size_t i) { return static_cast<double>(static_cast<const float*>(p)[i]); }},
      {z16.data(), c16.data(), WITCERT_DTYPE_F16,
       [](const void* p, std::size_t i) { return fp16_to_double(static_cast<const std::uint16_t*>(p)[i]); }},
      {zb.data(), cb.data(), WITCERT_DTYPE_BF16,
       [](const void* p, std::size_t i) { return bf16_value(static_cast<const std::uint16_t*>(p)[i]); }},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE("dtype " + std::to_string(cs.type));
    std::vector<witcert_bounds> got(rows);
    ASSERT_EQ(witcert_meter_logits_batch(cs.z, cs.type, cs.c, cs.type, rows, n, 1, got.data()), WITCERT_OK)
        << witcert_last_error();
    // Mixed: logits of this dtype, bounds in float64.
    std::vector<double> c_wide(rows * n), z_wide(rows * n);
    for (std::size_t i = 0; i < rows * n; ++i) z_wide[i] = cs.value(cs.z, i), c_wide[i] = cs.value(cs.c, i);
    std::vector<witcert_bounds> mixed(rows);
    ASSERT_EQ(witcert_meter_logits_batch(cs.z, cs.type, c_wide.data(), WITCERT_DTYPE_F64, rows, n, 1, mixed.data()),
              WITCERT_OK);
    for (std::size_t row = 0; row < rows; ++row) {
      witcert_bounds one{};
      ASSERT_EQ(witcert_meter_logits(z_wide.data() + row * n, c_wide.data() + row * n, n, &one), WITCERT_OK);
      EXPECT_TRUE(same(got[row], one)) << "row " << row;
      EXPECT_TRUE(same(mixed[row], one)) << "row " << row;
    }
  }
}

TEST(CApiBatch, ABadRowIsRefusedAndNamed) {
  const std::size_t rows = 400, n = 300;
  Rows r = random_rows(rows, n, 9);
  std::vector<witcert_bounds> out(rows);
  const auto expect = [&](witcert_status s, const std::string& a, const std::string& b) {
    EXPECT_EQ(s, WITCERT_ERROR_INVALID_ARGUMENT);
    const std::string msg = witcert_last_error();
    EXPECT_NE(msg.find(a), std::string::npos) << msg;
    EXPECT_NE(msg.find(b), std::string::npos) << msg;
  };
  // Two bad rows, on different threads' shares: the lower is named, whatever the thread count.
  r.z[5 * n + 2] = kNaN;
  r.z[350 * n + 7] = kNaN;
  for (int threads : {1, 2, 4})
    expect(witcert_meter_logits_batch(r.z.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, rows, n, threads,
                                      out.data()),
           "row 5:", "z[2] is NaN");
  r.z[5 * n + 2] = 0.0, r.z[350 * n + 7] = 0.0;
  r.c[17 * n + 4] = -0.5;
  expect(
      witcert_meter_logits_batch(r.z.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, rows, n, 0, out.data()),
      "row 17:", "c[4] is negative");
  r.c[17 * n + 4] = HUGE_VAL;  // +inf is a bound: no guarantee for that row, and none refused
  ASSERT_EQ(
      witcert_meter_logits_batch(r.z.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, rows, n, 0, out.data()),
      WITCERT_OK);
  EXPECT_EQ(out[17].meter, 1.0);
  r.p[9 * n] += 0.01;
  expect(
      witcert_meter_probs_batch(r.p.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, rows, n, 0, out.data()),
      "row 9:", "p_tilde sums to");
  // A row of masked logits only.
  std::vector<double> masked(n, -HUGE_VAL);
  expect(
      witcert_meter_logits_batch(masked.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, 1, n, 1, out.data()),
      "row 0:", "no finite logit");
  // fp16 holds infinities and NaN too: refused as the wide arrays are.
  std::vector<std::uint16_t> z16(n, fp16_from_double(0.5)), c16(n, fp16_from_double(0.1));
  z16[3] = 0x7e00;  // NaN
  expect(witcert_meter_logits_batch(z16.data(), WITCERT_DTYPE_F16, c16.data(), WITCERT_DTYPE_F16, 1, n, 1, out.data()),
         "row 0:", "z[3] is NaN");
  z16[3] = fp16_from_double(0.5);
  c16[8] = 0xfc00;  // -inf
  expect(witcert_meter_logits_batch(z16.data(), WITCERT_DTYPE_F16, c16.data(), WITCERT_DTYPE_F16, 1, n, 1, out.data()),
         "row 0:", "c[8] is -inf");
  // The arguments themselves.
  expect(witcert_meter_logits_batch(nullptr, WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, 1, n, 1, out.data()),
         "z", "NULL");
  expect(witcert_meter_logits_batch(r.z.data(), static_cast<witcert_dtype>(9), r.c.data(), WITCERT_DTYPE_F64, 1, n, 1,
                                    out.data()),
         "z", "dtype");
  expect(witcert_meter_probs_batch(r.p.data(), WITCERT_DTYPE_F64, r.c.data(), static_cast<witcert_dtype>(-1), 1, n, 1,
                                   out.data()),
         "c", "dtype");
  expect(witcert_meter_logits_batch(r.z.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, 1, 0, 1, out.data()),
         "n must", "at least 1");
  // No rows: nothing to do, and nothing written.
  EXPECT_EQ(witcert_meter_logits_batch(r.z.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, 0, n, 1, nullptr),
            WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(
      witcert_meter_logits_batch(r.z.data(), WITCERT_DTYPE_F64, r.c.data(), WITCERT_DTYPE_F64, 0, n, 1, out.data()),
      WITCERT_OK);
}

TEST(CApiBatch, WitnessesAndTierABoundsAreTheSingleCallsBitForBit) {
  const int d = 64, bands = 16, batch = 3, hq = 6, hk = 2;
  const std::size_t n = 37;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (witcert_rope_layout layout : {WITCERT_ROPE_INTERLEAVED, WITCERT_ROPE_NEOX}) {
    const std::size_t keys = static_cast<std::size_t>(batch) * hk * n;
    std::vector<float> k(keys * d), kh(keys * d);
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) * 2, kh[i] = k[i] + 0.05f * nd(rng);
    std::vector<std::uint16_t> w(keys * bands);
    ASSERT_EQ(witcert_witness_batch(d, bands, layout, kh.data(), WITCERT_DTYPE_F32, k.data(), WITCERT_DTYPE_F32, keys,
                                    w.data()),
              WITCERT_OK)
        << witcert_last_error();
    for (std::size_t t = 0; t < keys; t += 11) {
      std::vector<std::uint16_t> one(bands);
      ASSERT_EQ(witcert_witness(d, bands, layout, kh.data() + t * d, k.data() + t * d, one.data()), WITCERT_OK);
      EXPECT_EQ(std::memcmp(one.data(), w.data() + t * bands, bands * 2), 0) << "key " << t;
    }
    // bfloat16 keys: the witness of their float32 values.
    std::vector<std::uint16_t> kb(64), khb(64);
    std::vector<float> kbw(64), khbw(64);
    for (int i = 0; i < 64; ++i) {
      kb[i] = bf16_bits(k[i]), khb[i] = bf16_bits(kh[i]);
      kbw[i] = static_cast<float>(bf16_value(kb[i])), khbw[i] = static_cast<float>(bf16_value(khb[i]));
    }
    std::vector<std::uint16_t> wb(bands), wf(bands);
    ASSERT_EQ(witcert_witness_batch(d, bands, layout, khb.data(), WITCERT_DTYPE_BF16, kb.data(), WITCERT_DTYPE_BF16, 1,
                                    wb.data()),
              WITCERT_OK);
    ASSERT_EQ(witcert_witness(d, bands, layout, khbw.data(), kbw.data(), wf.data()), WITCERT_OK);
    EXPECT_EQ(wb, wf);

    std::vector<float> q(static_cast<std::size_t>(batch) * hq * d);
    for (float& x : q) x = nd(rng);
    std::vector<double> c(static_cast<std::size_t>(batch) * hq * n);
    for (int threads : {1, 0}) {
      ASSERT_EQ(witcert_tier_a_bounds_batch(d, bands, layout, q.data(), WITCERT_DTYPE_F32, w.data(), batch, hq, hk, n,
                                            0.125, threads, c.data()),
                WITCERT_OK)
          << witcert_last_error();
      for (int b = 0; b < batch; ++b)
        for (int h = 0; h < hq; ++h) {
          const int kv = h / (hq / hk);
          const std::uint16_t* wk = w.data() + (static_cast<std::size_t>(b) * hk + kv) * n * bands;
          std::vector<double> one(n);
          ASSERT_EQ(witcert_tier_a_bounds(d, bands, layout, q.data() + (b * hq + h) * d, wk, n, 0.125, one.data()),
                    WITCERT_OK);
          for (std::size_t t = 0; t < n; ++t) {
            const double got = c[(static_cast<std::size_t>(b) * hq + h) * n + t];
            EXPECT_EQ(std::memcmp(&got, &one[t], sizeof got), 0) << "b " << b << " h " << h << " t " << t;
            // And it bounds the logit error of that key.
            const float* kk = k.data() + ((static_cast<std::size_t>(b) * hk + kv) * n + t) * d;
            const float* kkh = kh.data() + ((static_cast<std::size_t>(b) * hk + kv) * n + t) * d;
            double eps = 0;
            for (int i = 0; i < d; ++i) eps += (static_cast<double>(kkh[i]) - kk[i]) * q[(b * hq + h) * d + i];
            EXPECT_LE(std::fabs(eps) * 0.125, got);
          }
        }
    }
  }
  // float64 keys or queries would be rounded: refused, named.
  std::vector<double> k64(64, 0.5);
  std::vector<std::uint16_t> w1(16);
  EXPECT_EQ(witcert_witness_batch(64, 16, WITCERT_ROPE_NEOX, k64.data(), WITCERT_DTYPE_F64, k64.data(),
                                  WITCERT_DTYPE_F64, 1, w1.data()),
            WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(witcert_last_error()).find("k_hat is float64"), std::string::npos) << witcert_last_error();
  std::vector<double> c1(1);
  EXPECT_EQ(witcert_tier_a_bounds_batch(64, 16, WITCERT_ROPE_NEOX, k64.data(), WITCERT_DTYPE_F64, w1.data(), 1, 1, 1, 1,
                                        0.125, 1, c1.data()),
            WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(witcert_last_error()).find("q is float64"), std::string::npos) << witcert_last_error();
  // A NaN key names its row; a NaN witness its batch and KV head.
  std::vector<float> kn(128, 0.5f);
  kn[64 + 9] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::uint16_t> w2(32);
  EXPECT_EQ(witcert_witness_batch(64, 16, WITCERT_ROPE_NEOX, kn.data(), WITCERT_DTYPE_F32, kn.data(), WITCERT_DTYPE_F32,
                                  2, w2.data()),
            WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(witcert_last_error()).find("row 1: k[9]"), std::string::npos) << witcert_last_error();
  std::vector<float> q1(2 * 64, 0.25f);
  std::vector<std::uint16_t> wn(2 * 16, fp16_from_double(0.1));
  wn[16 + 4] = 0x7e00;
  std::vector<double> c2(2);
  EXPECT_EQ(witcert_tier_a_bounds_batch(64, 16, WITCERT_ROPE_NEOX, q1.data(), WITCERT_DTYPE_F32, wn.data(), 2, 1, 1, 1,
                                        0.125, 1, c2.data()),
            WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(witcert_last_error()).find("batch 1, kv_head 0: witnesses[4]"), std::string::npos)
      << witcert_last_error();
}

// A pool and one sequence over it, freed together.
struct Sequence {
  witcert_pool* pool = nullptr;
  witcert_cache* cache = nullptr;
  Sequence(const witcert_geometry& g, const char* options) {
    EXPECT_EQ(witcert_pool_create(&g, options, 0, &pool), WITCERT_OK) << witcert_last_error();
    if (pool) {
      EXPECT_EQ(witcert_cache_create(pool, nullptr, 64, &cache), WITCERT_OK) << witcert_last_error();
    }
  }
  ~Sequence() {
    witcert_cache_free(cache);
    witcert_pool_free(pool);
  }
};

TEST(CApiBatch, AttentionOverARangeIsTheExactAttentionOverIt) {
  const witcert_geometry g{1, 4, 2, 64, 200, WITCERT_ROPE_NEOX};
  const int group = 2;
  std::mt19937 rng(21);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const char* options : {"{}", R"({"kv": "q4_0"})", R"({"kv": "dither-int8", "page_size": 4})",
                              R"({"kv": "q4_0", "tau_k": 0.2, "granularity": "block"})",
                              R"({"kv": "kivi-2bit", "kv_v": "q4_0", "page_size": 1})"})
    for (std::int64_t n : {6, 150}) {
      SCOPED_TRACE(std::string(options) + " n " + std::to_string(n));
      Sequence s(g, options);
      ASSERT_NE(s.cache, nullptr);
      std::vector<std::vector<float>> ks, vs;
      for (std::int64_t p = 0; p < n; ++p)
        for (int h = 0; h < g.kv_heads; ++h) {
          std::vector<float> k(64), v(64);
          for (int i = 0; i < 64; ++i) k[i] = nd(rng) * (i % 13 == 0 ? 6.0f : 1.0f), v[i] = nd(rng);
          ASSERT_EQ(witcert_cache_write(s.cache, 0, h, p, k.data(), v.data()), WITCERT_OK) << witcert_last_error();
          if (h == 1) ks.push_back(k), vs.push_back(v);
        }
      std::vector<float> q(group * 64), out(q.size());
      for (float& x : q) x = nd(rng);
      for (std::int64_t begin : {std::int64_t{0}, std::int64_t{1}, n / 2, n - 1}) {
        std::vector<witcert_cell> cells(group);
        ASSERT_EQ(witcert_cache_attend_range(s.cache, 0, 1, q.data(), group, begin, n, out.data(), cells.data()),
                  WITCERT_OK)
            << witcert_last_error();
        for (int h = 0; h < group; ++h) {
          // The exact attention over [begin, n) of the fp16 keys and values.
          std::vector<double> w;
          double mx = -HUGE_VAL, z = 0, err2 = 0;
          for (std::int64_t t = begin; t < n; ++t) {
            double sc = 0;
            for (int i = 0; i < 64; ++i)
              sc += static_cast<double>(q[h * 64 + i]) * fp16_to_double(fp16_from_double(ks[t][i]));
            w.push_back(sc / 8.0);
            mx = std::max(mx, sc / 8.0);
          }
          for (double& x : w) z += x = std::exp(x - mx);
          for (int i = 0; i < 64; ++i) {
            double y = 0;
            for (std::int64_t t = begin; t < n; ++t) y += w[t - begin] / z * fp16_to_double(fp16_from_double(vs[t][i]));
            err2 += (y - out[h * 64 + i]) * (y - out[h * 64 + i]);
          }
          const double bound = std::string(options) == "{}" ? 1e-5 : cells[h].output_bound;
          EXPECT_LE(std::sqrt(err2), bound * (1 + 1e-5) + 1e-5) << "begin " << begin << " head " << h;
          EXPECT_EQ(cells[h].pos, n - 1);
        }
      }
      std::vector<witcert_cell> cells(group);
      EXPECT_EQ(witcert_cache_attend_range(s.cache, 0, 1, q.data(), group, n, n, out.data(), cells.data()),
                WITCERT_ERROR_OUT_OF_RANGE);
      EXPECT_NE(std::string(witcert_last_error()).find("begin"), std::string::npos);
      EXPECT_EQ(witcert_cache_attend_range(s.cache, 0, 1, q.data(), group, -1, n, out.data(), cells.data()),
                WITCERT_ERROR_OUT_OF_RANGE);
      EXPECT_EQ(witcert_cache_attend_range(s.cache, 0, 1, q.data(), group, 0, n + 1, out.data(), cells.data()),
                WITCERT_ERROR_OUT_OF_RANGE);
    }
}

TEST(CApiBatch, WriteRowsIsThePerPositionWritesAndARefusalWritesNothing) {
  const witcert_geometry g{2, 4, 2, 64, 40, WITCERT_ROPE_NEOX};
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const char* options : {"{}", R"({"kv": "q4_0", "tau_k": 0.2})",
                              R"({"kv": "dither-int4", "kv_v": "dither-int5", "dither": "per-slot"})",
                              R"({"kv": "dither-int6", "key_scales": "channel"})"}) {
    SCOPED_TRACE(options);
    Sequence rows(g, options), single(g, options);
    const std::int64_t T = 13;
    std::vector<float> k(2 * T * 64), v(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(rng), v[i] = nd(rng);
    for (int l = 0; l < g.layers; ++l) {
      ASSERT_EQ(witcert_cache_write_rows(rows.cache, l, 0, T, k.data(), v.data(), nullptr, nullptr), WITCERT_OK)
          << witcert_last_error();
      for (int h = 0; h < 2; ++h)
        for (std::int64_t t = 0; t < T; ++t)
          ASSERT_EQ(
              witcert_cache_write(single.cache, l, h, t, k.data() + (h * T + t) * 64, v.data() + (h * T + t) * 64),
              WITCERT_OK);
    }
    std::vector<float> q(128, 0.3f), a(128), b(128);
    std::vector<witcert_cell> ca(2), cb(2);
    for (int l = 0; l < g.layers; ++l)
      for (int h = 0; h < 2; ++h) {
        ASSERT_EQ(witcert_cache_attend(rows.cache, l, h, q.data(), 2, T, a.data(), ca.data()), WITCERT_OK);
        ASSERT_EQ(witcert_cache_attend(single.cache, l, h, q.data(), 2, T, b.data(), cb.data()), WITCERT_OK);
        EXPECT_EQ(a, b);
        EXPECT_EQ(std::memcmp(ca.data(), cb.data(), sizeof(witcert_cell) * 2), 0);
      }
    // A value beyond fp16 in the last token of KV head 1: refused, named, and nothing written.
    std::vector<float> bad(k.begin(), k.end());
    bad[(1 * T + T - 1) * 64 + 7] = 1e6f;
    EXPECT_EQ(witcert_cache_write_rows(rows.cache, 0, T, T, bad.data(), v.data(), nullptr, nullptr),
              WITCERT_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(witcert_last_error()).find("k[1][12][7] is 1e+06"), std::string::npos)
        << witcert_last_error();
    EXPECT_EQ(witcert_cache_write_rows(rows.cache, 0, T, T, k.data(), v.data(), nullptr, nullptr), WITCERT_OK)
        << witcert_last_error();
    EXPECT_EQ(witcert_cache_write_rows(rows.cache, 1, 0, 1, k.data(), v.data(), nullptr, nullptr),
              WITCERT_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(witcert_last_error()).find("expected pos0 13"), std::string::npos) << witcert_last_error();
    EXPECT_EQ(witcert_cache_write_rows(rows.cache, 1, T, 40, k.data(), v.data(), nullptr, nullptr),
              WITCERT_ERROR_OUT_OF_RANGE);
  }
}

TEST(CApiBatch, ACausalRunIsItsPositionsCallsWithTheRunsSpan) {
  const witcert_geometry g{1, 4, 2, 64, 200, WITCERT_ROPE_NEOX};
  const int group = 2;
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const char* options : {"{}", R"({"kv": "q4_0"})", R"({"kv": "dither-int8", "kv_v": "dither-int5"})",
                              R"({"kv": "q4_0", "tau_k": 0.2, "page_size": 4})", R"({"kv": "kivi-2bit"})"})
    for (std::int64_t window : {0, 7}) {
      SCOPED_TRACE(std::string(options) + " window " + std::to_string(window));
      const bool dithered = std::string(options).find("dither") != std::string::npos;
      const bool gated = std::string(options).find("tau_k") != std::string::npos;
      Sequence run(g, options), single(g, options);
      const std::int64_t n = 70, pos0 = 20, tokens = n - pos0;
      std::vector<float> k(2 * n * 64), v(k.size());
      for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) * (i % 64 == 3 ? 6.0f : 1.0f), v[i] = nd(rng);
      ASSERT_EQ(witcert_cache_write_rows(run.cache, 0, 0, n, k.data(), v.data(), nullptr, nullptr), WITCERT_OK);
      ASSERT_EQ(witcert_cache_write_rows(single.cache, 0, 0, n, k.data(), v.data(), nullptr, nullptr), WITCERT_OK);
      std::vector<float> q((tokens + 1) * group * 64), out(q.size()), one(group * 64);  // a row to spare
      for (float& x : q) x = nd(rng);
      std::vector<witcert_cell> cells(tokens * group), c1(group);
      ASSERT_EQ(
          witcert_cache_attend_causal(run.cache, 0, 1, q.data(), group, pos0, tokens, window, out.data(), cells.data()),
          WITCERT_OK)
          << witcert_last_error();
      for (std::int64_t t = 0; t < tokens; ++t) {
        const std::int64_t pos = pos0 + t, begin = window > 0 ? std::max<std::int64_t>(0, pos - window + 1) : 0;
        ASSERT_EQ(witcert_cache_attend_range(single.cache, 0, 1, q.data() + t * group * 64, group, begin, pos + 1,
                                             one.data(), c1.data()),
                  WITCERT_OK);
        for (int h = 0; h < group; ++h) {
          const witcert_cell& a = cells[t * group + h];
          EXPECT_EQ(a.pos, pos);
          EXPECT_EQ(a.q_head, group + h);
          if (!gated) {  // a gate may repair a run's pages in another order than one position's
            for (int i = 0; i < 64; ++i) EXPECT_NEAR(out[(t * group + h) * 64 + i], one[h * 64 + i], 1e-5);
            if (dithered) {
              EXPECT_GE(a.raw, c1[h].raw * (1 - 1e-12));  // the run's wider span: a larger radius
            } else {
              EXPECT_NEAR(a.raw, c1[h].raw, 1e-9 * (1 + c1[h].raw));
            }
          } else {
            EXPECT_LE(a.meter, 0.2);
          }
        }
      }
      EXPECT_EQ(witcert_cache_attend_causal(run.cache, 0, 1, q.data(), group, pos0, tokens + 1, window, out.data(),
                                            cells.data()),
                WITCERT_ERROR_OUT_OF_RANGE);
      EXPECT_EQ(witcert_cache_attend_causal(run.cache, 0, 1, q.data(), group, pos0, 0, window, out.data(), nullptr),
                WITCERT_ERROR_INVALID_ARGUMENT);
      EXPECT_EQ(witcert_cache_attend_causal(run.cache, 0, 1, q.data(), group, pos0, 2, -1, out.data(), nullptr),
                WITCERT_ERROR_INVALID_ARGUMENT);
      std::vector<float> bad(q.begin(), q.begin() + 2 * group * 64);
      bad[group * 64 + 5] = std::numeric_limits<float>::infinity();
      EXPECT_EQ(witcert_cache_attend_causal(run.cache, 0, 1, bad.data(), group, pos0, 2, window, out.data(), nullptr),
                WITCERT_ERROR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(witcert_last_error()).find("q[133]"), std::string::npos) << witcert_last_error();
    }
}

// Softmax attention of one query over rows [0, n) of keys and values, in double.
std::vector<double> attention(const float* q, const std::vector<std::vector<double>>& k,
                              const std::vector<std::vector<double>>& v) {
  std::vector<double> w(k.size()), y(v[0].size(), 0.0);
  double mx = -HUGE_VAL, z = 0;
  for (std::size_t t = 0; t < k.size(); ++t) {
    double s = 0;
    for (std::size_t i = 0; i < k[t].size(); ++i) s += q[i] * k[t][i];
    mx = std::max(mx, w[t] = s / std::sqrt(static_cast<double>(k[t].size())));
  }
  for (double& x : w) z += x = std::exp(x - mx);
  for (std::size_t t = 0; t < k.size(); ++t)
    for (std::size_t i = 0; i < y.size(); ++i) y[i] += w[t] / z * v[t][i];
  return y;
}

TEST(CApiBatch, AnExternalSchemeServesTheCallersReconstructionsWithinItsMeter) {
  const witcert_geometry g{1, 2, 1, 64, 64, WITCERT_ROPE_NEOX};
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const char* options : {R"({"kv": "external"})", R"({"kv": "external", "kv_v": "q4_0"})",
                              R"({"kv": "q8_0", "kv_v": "external", "page_size": 4})",
                              R"({"kv": "external", "tau_k": 0.05, "tau_v": 0.02, "check_soundness": true})"}) {
    SCOPED_TRACE(options);
    const nlohmann::json o = nlohmann::json::parse(options);
    const bool ext_k = o.at("kv") == "external", ext_v = o.value("kv_v", o.at("kv").get<std::string>()) == "external";
    Sequence s(g, options);
    ASSERT_NE(s.cache, nullptr);
    const std::int64_t n = 40;
    std::vector<float> k(n * 64), v(n * 64), kh(n * 64), vh(n * 64);
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = nd(rng) * (i % 64 == 5 ? 5.0f : 1.0f), v[i] = nd(rng);
      kh[i] = k[i] + 0.1f * nd(rng), vh[i] = v[i] + 0.1f * nd(rng);
    }
    EXPECT_EQ(witcert_cache_write(s.cache, 0, 0, 0, k.data(), v.data()), WITCERT_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(witcert_last_error()).find("external"), std::string::npos);
    EXPECT_EQ(witcert_cache_write_rows(s.cache, 0, 0, n, k.data(), v.data(), ext_k ? nullptr : kh.data(),
                                       ext_v ? vh.data() : nullptr),
              WITCERT_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(witcert_last_error()).find("k_hat"), std::string::npos) << witcert_last_error();
    std::vector<float> bad = kh;
    bad[2 * 64 + 5] = std::numeric_limits<float>::quiet_NaN();
    if (ext_k) {
      EXPECT_EQ(witcert_cache_write_rows(s.cache, 0, 0, n, k.data(), v.data(), bad.data(), ext_v ? vh.data() : nullptr),
                WITCERT_ERROR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(witcert_last_error()).find("k_hat[0][2][5] is NaN"), std::string::npos)
          << witcert_last_error();
    }
    ASSERT_EQ(witcert_cache_write_rows(s.cache, 0, 0, n, k.data(), v.data(), ext_k ? kh.data() : nullptr,
                                       ext_v ? vh.data() : nullptr),
              WITCERT_OK)
        << witcert_last_error();
    std::vector<std::vector<double>> ke, ve, khat, vhat;
    for (std::int64_t t = 0; t < n; ++t) {
      std::vector<double> a(64), b(64), c(64), d(64);
      for (int i = 0; i < 64; ++i) {
        a[i] = fp16_to_double(fp16_from_double(k[t * 64 + i]));
        b[i] = fp16_to_double(fp16_from_double(v[t * 64 + i]));
        c[i] = kh[t * 64 + i], d[i] = vh[t * 64 + i];
      }
      ke.push_back(a), ve.push_back(b), khat.push_back(c), vhat.push_back(d);
    }
    std::vector<float> q(128), out(128);
    for (float& x : q) x = nd(rng);
    std::vector<witcert_cell> cells(2);
    ASSERT_EQ(witcert_cache_attend(s.cache, 0, 0, q.data(), 2, n, out.data(), cells.data()), WITCERT_OK)
        << witcert_last_error();
    for (int h = 0; h < 2; ++h) {
      const std::vector<double> exact = attention(q.data() + h * 64, ke, ve);
      double err2 = 0;
      for (int i = 0; i < 64; ++i) err2 += (exact[i] - out[h * 64 + i]) * (exact[i] - out[h * 64 + i]);
      EXPECT_LE(std::sqrt(err2), cells[h].output_bound * (1 + 1e-5) + 1e-5) << "head " << h;
      if (!o.contains("tau_k") && ext_k && ext_v) {
        // Unrepaired, the output is the attention over the caller's reconstructions.
        const std::vector<double> served = attention(q.data() + h * 64, khat, vhat);
        for (int i = 0; i < 64; ++i) EXPECT_NEAR(served[i], out[h * 64 + i], 2e-5) << "channel " << i;
        EXPECT_GT(cells[h].meter, 0.0);
      }
      if (o.contains("tau_k")) {
        EXPECT_LE(cells[h].meter, 0.05);
      }
    }
  }
  // An infinite reconstruction is no guarantee, never a certificate.
  Sequence s(g, R"({"kv": "external"})");
  std::vector<float> k(64, 0.5f), kh(64, 0.5f);
  kh[7] = HUGE_VALF;
  ASSERT_EQ(witcert_cache_write_rows(s.cache, 0, 0, 1, k.data(), k.data(), kh.data(), k.data()), WITCERT_OK)
      << witcert_last_error();
  std::vector<float> q(128, 0.25f), out(128);
  std::vector<witcert_cell> cells(2);
  witcert_cache_attend(s.cache, 0, 0, q.data(), 2, 1, out.data(), cells.data());
  EXPECT_EQ(cells[0].meter, 1.0);
  EXPECT_EQ(cells[0].raw, HUGE_VAL);
  // The CLI's and the server's options do not take the name.
  witcert_pool* pool = nullptr;
  const witcert_geometry g2{1, 2, 1, 64, 8, WITCERT_ROPE_NEOX};
  ASSERT_EQ(witcert_pool_create(&g2, R"({"kv": "external"})", 0, &pool), WITCERT_OK);
  witcert_cache* cache = nullptr;
  EXPECT_EQ(witcert_cache_create(pool, R"({"kv": "q4_0"})", 8, &cache), WITCERT_ERROR_INVALID_ARGUMENT);
  witcert_pool_free(pool);
}

TEST(CApiBatch, TheReportIsTheServersWitcertObject) {
  const witcert_geometry g{2, 4, 2, 64, 64, WITCERT_ROPE_NEOX};
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const auto run = [&](const char* options, std::int64_t prompt, std::int64_t n) {
    Sequence s(g, options);
    EXPECT_EQ(witcert_cache_report_start(s.cache, prompt), WITCERT_OK) << witcert_last_error();
    std::vector<float> k(64), v(64), q(128), out(128);
    std::vector<witcert_cell> cells(2);
    for (std::int64_t p = 0; p < n; ++p)
      for (int l = 0; l < g.layers; ++l)
        for (int h = 0; h < g.kv_heads; ++h) {
          for (int i = 0; i < 64; ++i) k[i] = nd(rng) * (i == 3 ? 9.0f : 1.0f), v[i] = nd(rng);
          for (float& x : q) x = nd(rng);
          EXPECT_EQ(witcert_cache_write(s.cache, l, h, p, k.data(), v.data()), WITCERT_OK);
          EXPECT_EQ(witcert_cache_attend(s.cache, l, h, q.data(), 2, p + 1, out.data(), cells.data()), WITCERT_OK);
        }
    size_t needed = 0;
    EXPECT_EQ(witcert_cache_report(s.cache, nullptr, 0, &needed), WITCERT_ERROR_BUFFER_TOO_SMALL);
    std::string text(needed, '\0');
    EXPECT_EQ(witcert_cache_report(s.cache, text.data(), needed - 1, &needed), WITCERT_ERROR_BUFFER_TOO_SMALL);
    EXPECT_EQ(witcert_cache_report(s.cache, text.data(), text.size(), &needed), WITCERT_OK) << witcert_last_error();
    text.resize(needed - 1);
    return nlohmann::json::parse(text);
  };
  const nlohmann::json gated = run(R"({"kv": "q4_0", "tau_k": 0.2, "check_soundness": true})", 10, 25);
  // Only the decode steps' cells: positions 10 .. 24, every layer and query head.
  EXPECT_EQ(gated.at("cells"), 15 * 2 * 4);
  EXPECT_EQ(gated.at("kv"), "q4_0");
  EXPECT_EQ(gated.at("gate").at("tau_k"), 0.2);
  EXPECT_EQ(gated.at("soundness_checked"), 15 * 2 * 4);
  EXPECT_EQ(gated.at("soundness_violations"), 0);
  for (const char* key : {"verdict", "reason", "coverage", "raw_p50", "raw_max", "worst", "page_ins", "page_in_bytes",
                          "certified", "above_tau_by_layer"})
    EXPECT_TRUE(gated.contains(key)) << key;
  EXPECT_NE(gated.at("verdict"), "unmetered");
  EXPECT_EQ(gated.at("coverage").at("k"), 1.0);  // the gate held every served cell to τ_K
  const nlohmann::json raw = run(R"({"kv": "q4_0"})", 0, 5);
  EXPECT_EQ(raw.at("cells"), 5 * 2 * 4);
  EXPECT_EQ(raw.at("gate"), nullptr);
  const nlohmann::json plain = run("{}", 0, 3);
  EXPECT_EQ(plain.at("verdict"), "unmetered");
  EXPECT_EQ(plain.at("cells"), 0);
  Sequence s(g, "{}");
  EXPECT_EQ(witcert_cache_report_start(s.cache, 65), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_cache_report(s.cache, nullptr, 0, nullptr), WITCERT_ERROR_INVALID_ARGUMENT);
}

}  // namespace
