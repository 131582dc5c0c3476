// The decode loop: chunked prefill of a prompt, then one token at a time until a stop token or
// the token budget, plus teacher-forced perplexity.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "attn/kv_cache.h"
#include "base/thread_pool.h"
#include "model/llama.h"
#include "model/sampler.h"

namespace witcert::model {

struct GenerateOptions {
  int max_new_tokens = 128;
  int prefill_chunk = 64;
  SamplerConfig sampler;
  std::vector<std::int32_t> stop_tokens;
};

struct GenerateResult {
  std::vector<std::int32_t> tokens;  // generated, stop token excluded
  std::int64_t prompt_tokens = 0;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;  // for tokens.size() forward passes after the first sample
  bool stopped = false;         // hit a stop token
};

// Throws std::out_of_range when prompt + budget exceed the model's context or the cache.
GenerateResult generate(const LlamaModel& model, std::span<const std::int32_t> prompt, attn::KvCache& cache,
                        ThreadPool& pool, const GenerateOptions& opts,
                        const std::function<void(std::int32_t)>& on_token = {});

// Mean negative log-likelihood (nats/token) of tokens[1..] given their prefixes; its exp is the
// perplexity.
double teacher_forced_nll(const LlamaModel& model, std::span<const std::int32_t> tokens, attn::KvCache& cache,
                          ThreadPool& pool, int chunk = 64);

}  // namespace witcert::model
