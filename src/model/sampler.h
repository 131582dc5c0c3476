// Next-token choice: greedy, or temperature + nucleus (top-p) sampling from a seeded stream.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace witcert::model {

struct SamplerConfig {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;        // in (0, 1]
  std::uint64_t seed = 0;
};

class Sampler {
 public:
  // Throws std::invalid_argument for a negative or non-finite temperature or top_p ∉ (0, 1].
  explicit Sampler(const SamplerConfig& cfg);

  std::int32_t sample(std::span<const float> logits);

 private:
  SamplerConfig cfg_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, std::int32_t>> candidates_;
};

// The index of the largest logit; the lowest index wins ties.
std::int32_t argmax(std::span<const float> logits);

}  // namespace witcert::model
