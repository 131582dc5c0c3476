#include "engine/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>

namespace witcert::engine {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Session::Session(const model::LlamaModel& model, kvcache::KvCache& cache, ThreadPool& pool, int prefill_chunk)
    : model_(model), cache_(cache), pool_(pool), chunk_(prefill_chunk), logits_(model.config().vocab) {
  if (prefill_chunk <= 0) throw std::invalid_argument("the prefill chunk must be positive");
}

std::int64_t Session::limit() const { return std::min(model_.config().context, cache_.geometry().capacity); }

std::span<const float> Session::prefill(std::span<const std::int32_t> prompt, const Progress& progress,
                                        const LogitsSink& rows) {
  const std::int64_t n = static_cast<std::int64_t>(prompt.size());
  if (pos_ != 0) throw std::logic_error("a session prefills once, before any step");
  if (n == 0) throw std::invalid_argument("the prompt is empty");
  if (n > limit())
    throw std::out_of_range("the prompt has " + std::to_string(n) + " tokens, more than the context of " +
                            std::to_string(limit()));
  const std::size_t V = logits_.size();
  if (rows) rows_.resize(static_cast<std::size_t>(chunk_) * V);
  cache_.set_prompt_length(n);
  for (std::int64_t p = 0; p < n; p += chunk_) {
    const std::int64_t m = std::min<std::int64_t>(chunk_, n - p);
    if (!rows) {
      model_.forward(prompt.subspan(p, m), p, cache_, pool_, logits_);
    } else {
      model_.forward(prompt.subspan(p, m), p, cache_, pool_, rows_, /*all_logits=*/true);
      for (std::int64_t i = 0; i < m; ++i) rows(p + i, {&rows_[i * V], V});
      std::copy_n(&rows_[(m - 1) * V], V, logits_.begin());
    }
    pos_ = p + m;
    if (progress) progress(pos_, n);
  }
  return logits_;
}

void Session::resume(std::int64_t pos, std::span<const float> logits) {
  if (pos_ != 0) throw std::logic_error("a session resumes once, before any step");
  if (pos <= 0 || pos > limit()) throw std::out_of_range("resume: position " + std::to_string(pos) + " outside the cache");
  if (logits.size() != logits_.size()) throw std::invalid_argument("resume: the logits are not vocab floats");
  std::copy(logits.begin(), logits.end(), logits_.begin());
  pos_ = pos;
}

std::span<const float> Session::step(std::int32_t token) {
  if (pos_ >= limit())
    throw std::out_of_range("position " + std::to_string(pos_) + " is beyond the context of " + std::to_string(limit()));
  model_.forward(std::span<const std::int32_t>(&token, 1), pos_, cache_, pool_, logits_);
  ++pos_;
  return logits_;
}

GenerateResult decode(Session& session, const GenerateOptions& opts, const TokenSink& on_token,
                      const ChoiceSink& on_choice) {
  if (opts.max_new_tokens < 0) throw std::invalid_argument("the token budget must not be negative");
  if (session.position() == 0) throw std::logic_error("decode needs a prefilled session");
  model::Sampler sampler(opts.sampler);
  GenerateResult r;
  const auto t0 = std::chrono::steady_clock::now();
  std::span<const float> logits = session.logits();
  for (int i = 0; i < opts.max_new_tokens; ++i) {
    if (on_choice) on_choice(logits);
    const std::int32_t next = sampler.sample(logits);
    if (std::find(opts.stop_tokens.begin(), opts.stop_tokens.end(), next) != opts.stop_tokens.end()) {
      r.stopped = true;
      break;
    }
    r.tokens.push_back(next);
    if (on_token) on_token(next);
    if (opts.cancel && opts.cancel->load()) {
      r.cancelled = true;
      break;
    }
    // No forward pass is needed after the last token.
    if (i + 1 == opts.max_new_tokens || session.position() >= session.limit()) break;
    logits = session.step(next);
  }
  r.decode_seconds = seconds_since(t0);
  return r;
}

GenerateResult generate(Session& session, std::span<const std::int32_t> prompt, const GenerateOptions& opts,
                        const TokenSink& on_token, const ChoiceSink& on_choice, const Progress& progress) {
  if (opts.max_new_tokens < 0) throw std::invalid_argument("the token budget must not be negative");
  model::Sampler{opts.sampler};  // rejects impossible sampling settings before any work
  const auto t0 = std::chrono::steady_clock::now();
  session.prefill(prompt, progress);
  const double prefill_seconds = seconds_since(t0);
  GenerateResult r = decode(session, opts, on_token, on_choice);
  r.prompt_tokens = static_cast<std::int64_t>(prompt.size());
  r.prefill_seconds = prefill_seconds;
  return r;
}

std::vector<double> log_softmax(std::span<const float> logits) {
  const double mx = *std::max_element(logits.begin(), logits.end());
  double s = 0.0;
  for (float v : logits) s += std::exp(v - mx);
  const double lse = mx + std::log(s);
  std::vector<double> out(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - lse;
  return out;
}

double teacher_forced_nll(Session& session, std::span<const std::int32_t> tokens) {
  const std::int64_t n = static_cast<std::int64_t>(tokens.size());
  if (n < 2) throw std::invalid_argument("perplexity needs at least two tokens");
  double nll = 0.0;
  session.prefill(tokens.first(n - 1), {}, [&](std::int64_t pos, std::span<const float> row) {
    const float mx = *std::max_element(row.begin(), row.end());
    double z = 0.0;
    for (float x : row) z += std::exp(static_cast<double>(x) - mx);
    nll += std::log(z) + mx - row[tokens[pos + 1]];
  });
  return nll / static_cast<double>(n - 1);
}

}  // namespace witcert::engine
