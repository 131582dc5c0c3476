#include "attention/cpu/exact_attention_fast.h"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "attention/reference/exact_attention.h"
#include "base/alloc_counter.h"

namespace witcert::attention {
namespace {

// Bit for bit the scalar exact_attention on every SIMD target, for GQA groups below and above
// the vector width, head dimensions with and without a partial vector, and fp16 values across
// the range (subnormals, the largest finite, infinities); NaN outputs where the scalar has them.
TEST(ExactFast, BitIdenticalToExactAttention) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> g(0.0f, 1.0f);
  long compared = 0;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    for (int d : {64, 128, 40, 6})
      for (int group : {1, 3, 7, 20})
        for (std::int64_t n : {1, 5, 77})
          for (int special = 0; special < 3; ++special) {
            std::vector<f16> k(n * d), v(n * d);
            for (std::size_t i = 0; i < k.size(); ++i) {
              k[i] = fp16_from_float(g(rng) * (i % 7 == 0 ? 20.0f : 1.0f));
              v[i] = fp16_from_float(g(rng) * (i % 5 == 0 ? 1e-6f : 1.0f));  // fp16 subnormals
            }
            if (special == 1) k[n / 2 * d] = kFp16PosInf, v[0] = 0x7BFF;  // +inf key, 65504
            if (special == 2) k[0] = 0xFC00, v[d - 1] = 0x7E00;           // −inf key, NaN value
            std::vector<float> q(group * d), want(group * d), got(group * d);
            for (float& x : q) x = g(rng);
            std::vector<const f16*> key_rows(n), value_rows(n);
            for (std::int64_t t = 0; t < n; ++t) key_rows[t] = &k[t * d], value_rows[t] = &v[t * d];
            for (int h = 0; h < group; ++h)
              exact_attention(
                  &q[h * d], [&](std::int64_t t) { return key_rows[t]; }, [&](std::int64_t t) { return value_rows[t]; },
                  n, d, &want[h * d]);
            exact_attention_group(q.data(), group, key_rows.data(), value_rows.data(), n, d, got.data());
            for (std::size_t i = 0; i < want.size(); ++i) {
              if (std::isnan(want[i])) {
                ASSERT_TRUE(std::isnan(got[i])) << "d " << d << " group " << group << " n " << n << " at " << i;
                continue;
              }
              ASSERT_EQ(std::memcmp(&want[i], &got[i], sizeof(float)), 0)
                  << want[i] << " vs " << got[i] << ", d " << d << " group " << group << " n " << n << " at " << i;
              ++compared;
            }
          }
  }
  hwy::SetSupportedTargetsForTest(0);
  std::printf("[exact-fast] %ld outputs compared bit for bit\n", compared);
}

// Queries with their own rows [begin, end) (a run of prefill positions, under a sliding window or
// not): each output bit for bit the scalar exact_attention over its own rows, on every SIMD target,
// whether the smallest begin is the first row or not.
TEST(ExactFast, QueriesOverTheirOwnRowsAreEachTheirOwnAttention) {
  std::mt19937_64 rng(12);
  std::normal_distribution<float> g(0.0f, 1.0f);
  long compared = 0;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    for (int d : {64, 40})
      for (int queries : {1, 3, 17, 48})
        for (const bool from_zero : {true, false}) {
          const std::int64_t n = 70;
          std::vector<f16> k(n * d), v(n * d);
          for (std::size_t i = 0; i < k.size(); ++i) {
            k[i] = fp16_from_float(g(rng) * (i % 7 == 0 ? 20.0f : 1.0f));
            v[i] = fp16_from_float(g(rng));
          }
          std::vector<std::int64_t> begins(queries), ends(queries);
          std::uniform_int_distribution<std::int64_t> end(1, n);
          for (int h = 0; h < queries; ++h) {
            ends[h] = end(rng);
            // Every other query keeps its whole prefix; the rest start anywhere before their end,
            // and never at row 0 when from_zero is false.
            const std::int64_t lo = from_zero ? 0 : std::min<std::int64_t>(3, ends[h] - 1);
            begins[h] = from_zero && h % 2 == 0 ? 0 : std::uniform_int_distribution<std::int64_t>(lo, ends[h] - 1)(rng);
          }
          ends[0] = n;  // one query ends at the last row
          std::vector<float> q(queries * d), want(queries * d), got(queries * d);
          for (float& x : q) x = g(rng);
          std::vector<const f16*> key_rows(n), value_rows(n);
          for (std::int64_t t = 0; t < n; ++t) key_rows[t] = &k[t * d], value_rows[t] = &v[t * d];
          for (int h = 0; h < queries; ++h) {
            const std::int64_t b = begins[h];
            exact_attention(
                &q[h * d], [&](std::int64_t t) { return key_rows[b + t]; },
                [&](std::int64_t t) { return value_rows[b + t]; }, ends[h] - b, d, &want[h * d]);
          }
          exact_attention_multi(q.data(), queries, begins.data(), ends.data(), key_rows.data(), value_rows.data(), d,
                                got.data());
          for (std::size_t i = 0; i < want.size(); ++i) {
            ASSERT_EQ(std::memcmp(&want[i], &got[i], sizeof(float)), 0)
                << want[i] << " vs " << got[i] << ", d " << d << " queries " << queries << " at " << i << " (rows "
                << begins[i / d] << ".." << ends[i / d] << ")";
            ++compared;
          }
        }
  }
  hwy::SetSupportedTargetsForTest(0);
  std::printf("[exact-fast] %ld outputs over their own rows compared bit for bit\n", compared);
}

// A caller's workspace, once a call has grown it, serves every smaller call without allocating,
// and what an earlier call left in it changes nothing: each output is bit for bit that of a fresh
// workspace, on every SIMD target.
TEST(ExactFast, AWarmWorkspaceAllocatesNothingAndKeepsNoTrace) {
  std::mt19937_64 rng(13);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int d_max = 128, group_max = 7;
  const std::int64_t n_max = 77;
  std::vector<f16> k(n_max * d_max), v(n_max * d_max);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = fp16_from_float(g(rng)), v[i] = fp16_from_float(g(rng));
  std::vector<float> q(group_max * d_max);
  for (float& x : q) x = g(rng);
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    ExactWorkspace ws;
    std::vector<float> got(group_max * d_max), want(group_max * d_max);
    const auto rows = [&](int d, std::vector<const f16*>& key_rows, std::vector<const f16*>& value_rows) {
      for (std::int64_t t = 0; t < n_max; ++t) key_rows[t] = &k[t * d], value_rows[t] = &v[t * d];
    };
    std::vector<const f16*> key_rows(n_max), value_rows(n_max);
    rows(d_max, key_rows, value_rows);
    exact_attention_group(q.data(), group_max, key_rows.data(), value_rows.data(), n_max, d_max, got.data(), ws);
    for (int d : {128, 64, 40})
      for (int group : {7, 3, 1})
        for (std::int64_t n : {77, 16, 1}) {
          rows(d, key_rows, value_rows);
          const long before = testing_util::thread_allocations();
          exact_attention_group(q.data(), group, key_rows.data(), value_rows.data(), n, d, got.data(), ws);
          EXPECT_EQ(testing_util::thread_allocations() - before, 0) << "d " << d << " group " << group << " n " << n;
          ExactWorkspace fresh;
          exact_attention_group(q.data(), group, key_rows.data(), value_rows.data(), n, d, want.data(), fresh);
          ASSERT_EQ(std::memcmp(got.data(), want.data(), sizeof(float) * group * d), 0)
              << "d " << d << " group " << group << " n " << n;
        }
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace
}  // namespace witcert::attention
