#include "model/matmul.h"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <vector>

namespace witcert::model {
namespace {

using formats::GgmlType;

// A rows × cols matrix of the given type: Gaussian weights through the reference quantizer, or
// for the K-quants (no quantizer here) random bytes with finite fp16 super-block scales.
std::vector<std::uint8_t> random_matrix(GgmlType t, std::int64_t rows, std::int64_t cols, std::mt19937_64& rng) {
  const std::size_t row_bytes = formats::ggml_row_bytes(t, cols);
  std::vector<std::uint8_t> m(rows * row_bytes);
  if (t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K) {
    std::uniform_int_distribution<int> byte(0, 255);
    for (std::uint8_t& b : m) b = static_cast<std::uint8_t>(byte(rng));
    const std::size_t block = formats::ggml_type_info(t)->block_bytes;
    for (std::size_t at = 0; at < m.size(); at += block) {
      // d = ±2^-6·(1 + mantissa), and for Q4_K and Q5_K dmin the same: finite, like a real model's.
      for (std::size_t off : t == GgmlType::Q6_K ? std::vector<std::size_t>{208} : std::vector<std::size_t>{0, 2}) {
        m[at + off + 1] = static_cast<std::uint8_t>((m[at + off + 1] & 0x83) | 0x24);
      }
    }
    return m;
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (float& v : w) v = normal(rng) * 0.05f;
    formats::quantize_row(t, w.data(), m.data() + r * row_bytes, cols);
  }
  return m;
}

std::vector<float> random_activations(std::int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

// max over (t, r) of |fast − reference| / Σ_i |W[r, i]·X[t, i]|.
double worst_relative_error(const WeightMatrix& w, const std::vector<float>& x, std::int64_t tokens,
                            const std::vector<float>& fast, const std::vector<float>& ref) {
  std::vector<float> row(w.cols);
  double worst = 0.0;
  for (std::int64_t r = 0; r < w.rows; ++r) {
    embedding_row(w, r, row.data());
    for (std::int64_t t = 0; t < tokens; ++t) {
      double scale = 0.0;
      for (std::int64_t i = 0; i < w.cols; ++i) scale += std::fabs(static_cast<double>(row[i]) * x[t * w.cols + i]);
      const double err = std::fabs(static_cast<double>(fast[t * w.rows + r]) - ref[t * w.rows + r]);
      if (err > 0.0) worst = std::max(worst, scale > 0.0 ? err / scale : INFINITY);
    }
  }
  return worst;
}

struct Shape {
  std::int64_t rows, cols, tokens;
};

// Runs fn once per SIMD target compiled in and supported by this CPU, each forced in turn.
template <class Fn>
void for_each_target(Fn fn) {
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    std::printf("target %s\n", hwy::TargetName(target));
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    fn();
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(Matmul, FastMatchesReferenceForEveryType) {
  const GgmlType types[] = {GgmlType::F32,    GgmlType::F16,  GgmlType::BF16, GgmlType::Q4_0,
                            GgmlType::Q4_1,   GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
                            GgmlType::IQ4_NL, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K};
  // Row counts around the 4-, 2- and 1-row tiles and the 16-row cache block, token counts around
  // the 8- and 4-token tiles; cols from one block to 2048.
  const Shape shapes[] = {{1, 256, 1},    {3, 512, 2}, {17, 256, 5}, {300, 256, 3},
                          {33, 2048, 17}, {5, 768, 4}, {9, 512, 11}, {18, 256, 24}};
  const Shape small_block_shapes[] = {{1, 32, 1}, {7, 96, 3}, {18, 576, 6}, {2, 2048, 1}, {5, 64, 9}};
  std::mt19937_64 rng(3);
  ThreadPool pools[] = {ThreadPool(1), ThreadPool(2), ThreadPool(3)};
  double worst = 0.0;
  for_each_target([&] {
    for (GgmlType t : types) {
      const bool k_quant = formats::ggml_type_info(t)->block_size == 256;
      std::vector<Shape> cases(std::begin(shapes), std::end(shapes));
      if (!k_quant) cases.insert(cases.end(), std::begin(small_block_shapes), std::end(small_block_shapes));
      for (std::size_t c = 0; c < cases.size(); ++c) {
        const Shape& s = cases[c];
        SCOPED_TRACE(testing::Message() << formats::ggml_type_info(t)->name << " " << s.rows << "×" << s.cols
                                        << ", tokens " << s.tokens);
        const std::vector<std::uint8_t> data = random_matrix(t, s.rows, s.cols, rng);
        const WeightMatrix w = {t, data.data(), s.rows, s.cols};
        const std::vector<float> x = random_activations(s.tokens * s.cols, rng);
        std::vector<float> ref(s.tokens * s.rows), fast(s.tokens * s.rows, NAN);
        matmul_reference(w, x.data(), s.tokens, ref.data());
        matmul(w, x.data(), s.tokens, fast.data(), pools[c % 3]);
        if (c % 3 != 0) {  // a row's sum does not depend on how rows are split across threads
          std::vector<float> single(fast.size());
          matmul(w, x.data(), s.tokens, single.data(), pools[0]);
          EXPECT_EQ(single, fast);
        }
        // Nor on the tokens beside it: each token alone gives the same bits as in the tile.
        for (std::int64_t tok = 0; tok < s.tokens; ++tok) {
          std::vector<float> alone(s.rows);
          matmul(w, &x[tok * s.cols], 1, alone.data(), pools[0]);
          ASSERT_TRUE(std::equal(alone.begin(), alone.end(), &fast[tok * s.rows])) << "token " << tok;
        }
        const double e = worst_relative_error(w, x, s.tokens, fast, ref);
        EXPECT_LE(e, 1e-5);
        worst = std::max(worst, e);
      }
    }
  });
  std::printf("worst |fast - reference| / sum|W*X| = %.3g\n", worst);
}

// Columns that are not a whole number of 32 (F32, F16, BF16 only) take the generic path.
TEST(Matmul, FloatTypesWithRaggedColumns) {
  std::mt19937_64 rng(4);
  ThreadPool pool(2);
  for_each_target([&] {
    for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16}) {
      for (std::int64_t cols : {1, 7, 45}) {
        const std::vector<std::uint8_t> data = random_matrix(t, 9, cols, rng);
        const WeightMatrix w = {t, data.data(), 9, cols};
        const std::vector<float> x = random_activations(3 * cols, rng);
        std::vector<float> ref(27), fast(27);
        matmul_reference(w, x.data(), 3, ref.data());
        matmul(w, x.data(), 3, fast.data(), pool);
        EXPECT_LE(worst_relative_error(w, x, 3, fast, ref), 1e-5);
      }
    }
  });
}

// Hand-worked: Q4_1 with d = 0.5, m = −2 and nibbles j | (15 − j) << 4 has weights 0.5j − 2 and
// 0.5(15 − j) − 2 (j < 16), which sum to 56; Q8_0 with d = 0.25 and codes 1..32 sums to 132.
TEST(Matmul, KnownAnswers) {
  std::vector<std::uint8_t> q41(20), q80(34);
  q41[0] = 0x00, q41[1] = 0x38, q41[2] = 0x00, q41[3] = 0xC0;
  for (int j = 0; j < 16; ++j) q41[4 + j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
  q80[0] = 0x00, q80[1] = 0x34;
  for (int j = 0; j < 32; ++j) q80[2 + j] = static_cast<std::uint8_t>(j + 1);
  std::vector<float> x(64);
  std::fill(x.begin(), x.begin() + 32, 1.0f);  // token 0: all ones; token 1: all twos
  std::fill(x.begin() + 32, x.end(), 2.0f);
  ThreadPool pool(1);
  for (const auto& [type, data, want] :
       {std::tuple{GgmlType::Q4_1, &q41, 56.0f}, std::tuple{GgmlType::Q8_0, &q80, 132.0f}}) {
    const WeightMatrix w = {type, data->data(), 1, 32};
    float y[2], y_ref[2];
    matmul(w, x.data(), 2, y, pool);
    matmul_reference(w, x.data(), 2, y_ref);
    EXPECT_EQ(y[0], want);
    EXPECT_EQ(y[1], 2 * want);
    EXPECT_EQ(y_ref[0], want);
    EXPECT_EQ(y_ref[1], 2 * want);
  }
}

TEST(Matmul, EmbeddingRowIsTheDequantizedRow) {
  std::mt19937_64 rng(5);
  const std::vector<std::uint8_t> data = random_matrix(GgmlType::Q8_0, 10, 64, rng);
  const WeightMatrix w = {GgmlType::Q8_0, data.data(), 10, 64};
  std::vector<float> got(64), want(64);
  embedding_row(w, 7, got.data());
  formats::dequantize_row(GgmlType::Q8_0, data.data() + 7 * 68, want.data(), 64);
  EXPECT_EQ(got, want);
  EXPECT_THROW(embedding_row(w, 10, got.data()), std::out_of_range);
  EXPECT_THROW(embedding_row(w, -1, got.data()), std::out_of_range);
}

TEST(Matmul, Errors) {
  std::vector<std::uint8_t> data(4096);
  std::vector<float> x(512), y(512);
  ThreadPool pool(1);
  const WeightMatrix q2k = {GgmlType::Q2_K, data.data(), 1, 256};
  EXPECT_THROW(matmul(q2k, x.data(), 1, y.data(), pool), std::invalid_argument);
  EXPECT_THROW(matmul_reference(q2k, x.data(), 1, y.data()), std::invalid_argument);
  const WeightMatrix ragged = {GgmlType::Q4_0, data.data(), 1, 40};
  EXPECT_THROW(matmul(ragged, x.data(), 1, y.data(), pool), std::invalid_argument);
  EXPECT_THROW(embedding_row(ragged, 0, y.data()), std::invalid_argument);
  const WeightMatrix ok = {GgmlType::Q4_0, data.data(), 2, 64};
  y[0] = 42.0f;
  matmul(ok, x.data(), 0, y.data(), pool);  // no tokens: nothing written
  EXPECT_EQ(y[0], 42.0f);
}

}  // namespace
}  // namespace witcert::model
