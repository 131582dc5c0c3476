#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "apps/engine.h"
#include "attn/exact_cache.h"
#include "model/generate.h"

namespace witcert::apps {

int run_generate(const GenerateArgs& args, std::ostream& out, std::ostream& err) {
  Engine engine = Engine::load(args.model.empty() ? default_model_path() : args.model);
  const std::vector<std::int32_t> prompt = engine.prompt_tokens(args.prompt, args.chat);
  const model::LlamaConfig& cfg = engine.model->config();
  if (static_cast<std::int64_t>(prompt.size()) > cfg.context)
    throw std::out_of_range("the prompt has " + std::to_string(prompt.size()) + " tokens, more than the model's context of " +
                            std::to_string(cfg.context));
  const std::int64_t capacity = std::min<std::int64_t>(cfg.context, static_cast<std::int64_t>(prompt.size()) + args.n);
  attn::ExactKvCache cache(cfg.kv_geometry(capacity));
  ThreadPool pool(args.threads);

  model::GenerateOptions opts;
  opts.max_new_tokens = args.n;
  opts.sampler = {args.temperature, args.top_p, args.seed};
  opts.stop_tokens = engine.stop_tokens();
  const model::GenerateResult r = model::generate(*engine.model, prompt, cache, pool, opts, [&](std::int32_t t) {
    out << engine.tokenizer->token_piece(t) << std::flush;
  });
  out << "\n";
  const double decoded = r.tokens.empty() ? 0.0 : static_cast<double>(r.tokens.size() - (r.stopped ? 0 : 1));
  err << fmt::format("prefill: {} tokens, {:.1f} tok/s; decode: {} tokens, {:.1f} tok/s ({} threads)\n",
                     r.prompt_tokens, r.prompt_tokens / r.prefill_seconds, r.tokens.size(),
                     decoded > 0 ? decoded / r.decode_seconds : 0.0, pool.size());
  return 0;
}

int run_logits(const LogitsArgs& args, std::ostream& out) {
  Engine engine = Engine::load(args.model.empty() ? default_model_path() : args.model);
  const std::vector<std::int32_t> prompt = engine.prompt_tokens(args.prompt, args.chat);
  const model::LlamaConfig& cfg = engine.model->config();
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
  if (static_cast<std::int64_t>(prompt.size()) > cfg.context)
    throw std::out_of_range("the prompt has " + std::to_string(prompt.size()) + " tokens, more than the model's context of " +
                            std::to_string(cfg.context));
  if (args.top < 1) throw std::invalid_argument("--top must be at least 1");
  attn::ExactKvCache cache(cfg.kv_geometry(static_cast<std::int64_t>(prompt.size())));
  ThreadPool pool(args.threads);
  std::vector<float> logits(cfg.vocab);
  for (std::size_t p = 0; p < prompt.size(); p += 64) {
    const std::size_t m = std::min<std::size_t>(64, prompt.size() - p);
    engine.model->forward(std::span<const std::int32_t>(prompt).subspan(p, m), static_cast<std::int64_t>(p), cache, pool,
                          logits);
  }
  std::vector<std::int32_t> order(cfg.vocab);
  for (int i = 0; i < cfg.vocab; ++i) order[i] = i;
  const int k = std::min(args.top, cfg.vocab);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](std::int32_t a, std::int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  nlohmann::json top = nlohmann::json::array();
  for (int i = 0; i < k; ++i)
    top.push_back({{"id", order[i]}, {"piece", engine.tokenizer->token_piece(order[i])}, {"logit", logits[order[i]]}});
  out << nlohmann::json{{"prompt_tokens", prompt}, {"top", top}}.dump(-1, ' ', false,
                                                                      nlohmann::json::error_handler_t::replace)
      << "\n";
  return 0;
}

}  // namespace witcert::apps
