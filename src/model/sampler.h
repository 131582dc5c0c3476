// Next-token choice: greedy, or temperature sampling from a seeded stream, restricted to the k
// most likely tokens (top-k) and then to the nucleus of mass top_p among them.
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
  int top_k = 0;             // ≥ 1: sample among the top_k most likely tokens; 0: every token
};

class Sampler {
 public:
  // Throws std::invalid_argument for a negative or non-finite temperature, top_p ∉ (0, 1] or a
  // negative top_k.
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
