// The position runner: a session runs a model over one cache it is given — the prompt in chunks
// (announced to the cache first), then one position at a time. The experiments (demo, eval,
// logits) drive it to teacher-force, resume a prefilled cache or run a cache built by hand, and
// the tests use it as the reference a request in the batch engine equals bit for bit. Requests
// themselves run in the batch engine (batch.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "base/thread_pool.h"
#include "kvcache/kv_cache.h"
#include "model/llama.h"
#include "model/sampler.h"

namespace witcert::engine {

using Progress = std::function<void(std::int64_t done, std::int64_t total)>;
// Receives the logits of a position run (vocab floats), in position order.
using LogitsSink = std::function<void(std::int64_t pos, std::span<const float> logits)>;

class Session {
 public:
  // The model, cache and pool must outlive the session; the cache should be empty.
  Session(const model::LlamaModel& model, kvcache::KvCache& cache, ThreadPool& pool, int prefill_chunk = 64);

  // Announces the prompt to the cache and runs it in chunks; `rows` (when set) receives every
  // position's logits, `progress` the positions done after each chunk. Returns the last
  // position's logits. Throws for an empty prompt, one beyond the context or the cache, or a
  // second prefill.
  std::span<const float> prefill(std::span<const std::int32_t> prompt, const Progress& progress = {},
                                 const LogitsSink& rows = {});
  // Continues a cache that already holds positions [0, pos) whose last logits are `logits` (a copy
  // of a prefilled cache), instead of prefilling.
  void resume(std::int64_t pos, std::span<const float> logits);
  // Runs one token at the next position and returns its logits. Throws std::out_of_range beyond
  // limit().
  std::span<const float> step(std::int32_t token);

  std::span<const float> logits() const { return logits_; }  // of the last position run
  std::int64_t position() const { return pos_; }              // positions run so far
  std::int64_t limit() const;                                  // min(model context, cache capacity)
  const model::LlamaModel& model() const { return model_; }

 private:
  const model::LlamaModel& model_;
  kvcache::KvCache& cache_;
  ThreadPool& pool_;
  int chunk_;
  std::int64_t pos_ = 0;
  std::vector<float> logits_;  // vocab; reused by every step
  std::vector<float> rows_;    // chunk × vocab, when a prefill keeps every row
};

struct GenerateOptions {
  int max_new_tokens = 128;
  model::SamplerConfig sampler;
  std::vector<std::int32_t> stop_tokens;
  // When set, read after each token is handed to on_token: true ends the generation there.
  const std::atomic<bool>* cancel = nullptr;
};

struct GenerateResult {
  std::vector<std::int32_t> tokens;  // generated, stop token excluded
  std::int64_t prompt_tokens = 0;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;  // for tokens.size() forward passes after the first sample
  bool stopped = false;         // hit a stop token
  bool cancelled = false;       // ended by GenerateOptions::cancel
};

using TokenSink = std::function<void(std::int32_t)>;
using ChoiceSink = std::function<void(std::span<const float> logits)>;

// From a prefilled (or resumed) session, samples up to max_new_tokens, stopping at a stop token
// or the limit. on_token receives each token as it is chosen, on_choice the logits it was chosen
// from. prompt_tokens and prefill_seconds of the result are left 0.
GenerateResult decode(Session& session, const GenerateOptions& opts, const TokenSink& on_token = {},
                      const ChoiceSink& on_choice = {});

// Prefills the prompt, then decodes.
GenerateResult generate(Session& session, std::span<const std::int32_t> prompt, const GenerateOptions& opts,
                        const TokenSink& on_token = {}, const ChoiceSink& on_choice = {},
                        const Progress& progress = {});

// Mean negative log-likelihood (nats/token) of tokens[1..] given their prefixes, teacher-forced
// through a fresh session; its exp is the perplexity.
double teacher_forced_nll(Session& session, std::span<const std::int32_t> tokens);

// log softmax of logits, in double.
std::vector<double> log_softmax(std::span<const float> logits);

}  // namespace witcert::engine
