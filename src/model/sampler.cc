#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace witcert::model {

Sampler::Sampler(const SamplerConfig& cfg) : cfg_(cfg), rng_(cfg.seed) {
  if (!(cfg.temperature >= 0.0f) || !std::isfinite(cfg.temperature))
    throw std::invalid_argument("temperature must be a finite number ≥ 0, got " + std::to_string(cfg.temperature));
  if (!(cfg.top_p > 0.0f && cfg.top_p <= 1.0f))
    throw std::invalid_argument("top-p must lie in (0, 1], got " + std::to_string(cfg.top_p));
  if (cfg.top_k < 0) throw std::invalid_argument("top-k must be ≥ 0 (0: every token), got " + std::to_string(cfg.top_k));
}

std::int32_t argmax(std::span<const float> logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

std::int32_t Sampler::sample(std::span<const float> logits) {
  if (cfg_.temperature == 0.0f) return argmax(logits);
  // Softmax at temperature T over candidates sorted by probability, cut to the top_k most likely,
  // then at cumulative mass top_p of what is left.
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  candidates_.resize(logits.size());
  double total = 0.0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const float p = std::exp((logits[i] - max_logit) / cfg_.temperature);
    candidates_[i] = {p, static_cast<std::int32_t>(i)};
    total += p;
  }
  const auto more_likely = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::size_t keep = candidates_.size();
  if (cfg_.top_k > 0 && static_cast<std::size_t>(cfg_.top_k) < keep) {
    keep = static_cast<std::size_t>(cfg_.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(keep), candidates_.end(),
                      more_likely);
    total = 0.0;
    for (std::size_t i = 0; i < keep; ++i) total += candidates_[i].first;
  } else {
    std::sort(candidates_.begin(), candidates_.end(), more_likely);
  }
  double kept_mass = total;
  if (cfg_.top_p < 1.0f) {
    double cumulative = 0.0;
    for (std::size_t i = 0; i < keep; ++i) {
      cumulative += candidates_[i].first;
      if (cumulative >= cfg_.top_p * total) {
        keep = i + 1;
        kept_mass = cumulative;
        break;
      }
    }
  }
  const double r = std::uniform_real_distribution<double>(0.0, kept_mass)(rng_);
  double cumulative = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    cumulative += candidates_[i].first;
    if (r < cumulative) return candidates_[i].second;
  }
  return candidates_[keep - 1].second;
}

}  // namespace witcert::model
