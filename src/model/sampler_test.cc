// The sampler: greedy is the argmax (lowest index on ties); top-k keeps the k most likely tokens
// and top-p the nucleus of what is left, with frequencies that follow the renormalized softmax
// (known answers, checked to within five standard errors over 20,000 draws); a seed fixes the
// stream; impossible settings are refused.
#include "model/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <stdexcept>
#include <vector>

namespace witcert::model {
namespace {

// Logits whose softmax at temperature 1 is `p` (p > 0).
std::vector<float> logits_of(const std::vector<double>& p) {
  std::vector<float> z;
  for (double x : p) z.push_back(static_cast<float>(std::log(x)));
  return z;
}

// Draws `n` tokens from one sampler and counts them.
std::map<std::int32_t, int> draws(const SamplerConfig& cfg, const std::vector<float>& z, int n) {
  Sampler s(cfg);
  std::map<std::int32_t, int> count;
  for (int i = 0; i < n; ++i) ++count[s.sample(z)];
  return count;
}

// Every drawn token is one of `want`'s, with a frequency within five standard errors of it.
void expect_frequencies(const std::map<std::int32_t, int>& got, const std::map<std::int32_t, double>& want, int n) {
  for (const auto& [token, c] : got) EXPECT_TRUE(want.count(token)) << "token " << token << " drawn " << c << " times";
  for (const auto& [token, p] : want) {
    const double f = got.count(token) ? static_cast<double>(got.at(token)) / n : 0.0;
    EXPECT_NEAR(f, p, 5 * std::sqrt(p * (1 - p) / n)) << "token " << token;
  }
}

TEST(Sampler, GreedyIsTheArgmaxWithTheLowestIndexOnTies) {
  const std::vector<float> z = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(argmax(z), 1);
  Sampler greedy({0.0f, 1.0f, 7, 0});
  for (int i = 0; i < 10; ++i) EXPECT_EQ(greedy.sample(z), 1);
  // top_k 1 is greedy at any temperature.
  Sampler one({1.5f, 1.0f, 7, 1});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(one.sample(z), 1);
}

TEST(Sampler, TopKAndTopPFollowTheRenormalizedSoftmax) {
  constexpr int kN = 20000;
  const std::vector<float> z = logits_of({0.1, 0.4, 0.2, 0.3});  // ranks: 1, 3, 2, 0
  expect_frequencies(draws({1.0f, 1.0f, 11, 0}, z, kN), {{0, 0.1}, {1, 0.4}, {2, 0.2}, {3, 0.3}}, kN);
  // top_k 3: tokens 1, 3, 2 renormalized over 0.9.
  expect_frequencies(draws({1.0f, 1.0f, 12, 3}, z, kN), {{1, 0.4 / 0.9}, {3, 0.3 / 0.9}, {2, 0.2 / 0.9}}, kN);
  // top_p 0.6: 0.4 + 0.3 ≥ 0.6 keeps tokens 1 and 3.
  expect_frequencies(draws({1.0f, 0.6f, 13, 0}, z, kN), {{1, 0.4 / 0.7}, {3, 0.3 / 0.7}}, kN);
  // top_k 3, then top_p 0.8 of its mass 0.9 = 0.72: 0.4 + 0.3 falls short, so token 2 stays too.
  expect_frequencies(draws({1.0f, 0.8f, 14, 3}, z, kN), {{1, 0.4 / 0.9}, {3, 0.3 / 0.9}, {2, 0.2 / 0.9}}, kN);
  // top_k 3, top_p 0.7 of 0.9 = 0.63: reached at 0.4 + 0.3, so tokens 1 and 3.
  expect_frequencies(draws({1.0f, 0.7f, 15, 3}, z, kN), {{1, 0.4 / 0.7}, {3, 0.3 / 0.7}}, kN);
  // Temperature 2 flattens: p ∝ sqrt(p).
  const double s = std::sqrt(0.1) + std::sqrt(0.4) + std::sqrt(0.2) + std::sqrt(0.3);
  expect_frequencies(draws({2.0f, 1.0f, 16, 0}, z, kN),
                     {{0, std::sqrt(0.1) / s}, {1, std::sqrt(0.4) / s}, {2, std::sqrt(0.2) / s}, {3, std::sqrt(0.3) / s}},
                     kN);
  // A k beyond the vocabulary keeps every token.
  expect_frequencies(draws({1.0f, 1.0f, 17, 100}, z, kN), {{0, 0.1}, {1, 0.4}, {2, 0.2}, {3, 0.3}}, kN);
}

TEST(Sampler, ASeedFixesTheStream) {
  const std::vector<float> z = logits_of({0.1, 0.4, 0.2, 0.3});
  for (int k : {0, 2}) {
    Sampler a({0.9f, 0.95f, 42, k}), b({0.9f, 0.95f, 42, k}), c({0.9f, 0.95f, 43, k});
    std::vector<std::int32_t> sa, sb, sc;
    for (int i = 0; i < 200; ++i) sa.push_back(a.sample(z)), sb.push_back(b.sample(z)), sc.push_back(c.sample(z));
    EXPECT_EQ(sa, sb);
    EXPECT_NE(sa, sc);
  }
}

TEST(Sampler, ImpossibleSettingsAreRefused) {
  for (const SamplerConfig& bad : {SamplerConfig{-0.1f, 1.0f, 0, 0}, SamplerConfig{NAN, 1.0f, 0, 0},
                                   SamplerConfig{INFINITY, 1.0f, 0, 0}, SamplerConfig{1.0f, 0.0f, 0, 0},
                                   SamplerConfig{1.0f, 1.5f, 0, 0}, SamplerConfig{1.0f, NAN, 0, 0},
                                   SamplerConfig{1.0f, 1.0f, 0, -1}})
    EXPECT_THROW(Sampler{bad}, std::invalid_argument) << bad.temperature << " " << bad.top_p << " " << bad.top_k;
}

}  // namespace
}  // namespace witcert::model
