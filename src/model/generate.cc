#include "model/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>

namespace witcert::model {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

GenerateResult generate(const LlamaModel& model, std::span<const std::int32_t> prompt, attn::KvCache& cache,
                        ThreadPool& pool, const GenerateOptions& opts,
                        const std::function<void(std::int32_t)>& on_token) {
  const std::int64_t n = static_cast<std::int64_t>(prompt.size());
  const std::int64_t limit = std::min(model.config().context, cache.geometry().capacity);
  if (n == 0) throw std::invalid_argument("the prompt is empty");
  if (n > limit)
    throw std::out_of_range("the prompt has " + std::to_string(n) + " tokens, more than the context of " +
                            std::to_string(limit));
  if (opts.max_new_tokens < 0 || opts.prefill_chunk <= 0)
    throw std::invalid_argument("token budget must be ≥ 0 and the prefill chunk > 0");
  Sampler sampler(opts.sampler);
  GenerateResult r;
  r.prompt_tokens = n;
  std::vector<float> logits(model.config().vocab);

  auto t0 = std::chrono::steady_clock::now();
  cache.set_prompt_length(n);
  for (std::int64_t p = 0; p < n; p += opts.prefill_chunk) {
    const std::int64_t m = std::min<std::int64_t>(opts.prefill_chunk, n - p);
    model.forward(prompt.subspan(p, m), p, cache, pool, logits);
  }
  r.prefill_seconds = seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  std::int64_t pos = n;
  for (int i = 0; i < opts.max_new_tokens; ++i) {
    const std::int32_t next = sampler.sample(logits);
    if (std::find(opts.stop_tokens.begin(), opts.stop_tokens.end(), next) != opts.stop_tokens.end()) {
      r.stopped = true;
      break;
    }
    r.tokens.push_back(next);
    if (on_token) on_token(next);
    if (i + 1 == opts.max_new_tokens || pos >= limit) break;  // no forward pass is needed after the last token
    model.forward(std::span<const std::int32_t>(&next, 1), pos++, cache, pool, logits);
  }
  r.decode_seconds = seconds_since(t0);
  return r;
}

double teacher_forced_nll(const LlamaModel& model, std::span<const std::int32_t> tokens, attn::KvCache& cache,
                          ThreadPool& pool, int chunk) {
  const std::int64_t n = static_cast<std::int64_t>(tokens.size());
  if (n < 2) throw std::invalid_argument("perplexity needs at least two tokens");
  const int V = model.config().vocab;
  std::vector<float> logits(static_cast<std::size_t>(chunk) * V);
  double nll = 0.0;
  for (std::int64_t p = 0; p < n - 1; p += chunk) {
    const std::int64_t m = std::min<std::int64_t>(chunk, n - 1 - p);
    model.forward(tokens.subspan(p, m), p, cache, pool, logits, /*all_logits=*/true);
    for (std::int64_t i = 0; i < m; ++i) {
      const float* row = &logits[i * V];
      const float mx = *std::max_element(row, row + V);
      double z = 0.0;
      for (int j = 0; j < V; ++j) z += std::exp(static_cast<double>(row[j]) - mx);
      nll += std::log(z) + mx - row[tokens[p + i + 1]];
    }
  }
  return nll / static_cast<double>(n - 1);
}

}  // namespace witcert::model
