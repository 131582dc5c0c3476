#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "apps/engine.h"
#include "attn/certified_cache.h"
#include "attn/exact_cache.h"
#include "model/generate.h"

namespace witcert::apps {
namespace {

nlohmann::json json_number(double v) {
  if (std::isnan(v)) return nullptr;
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// The meter summary of a run: decode-step cells only (positions at or after the prompt's end).
void summarize(const attn::CertifiedKvCache& cache, const GenerateArgs& args, std::int64_t prompt_len,
               const model::LlamaConfig& cfg, std::ostream& err) {
  std::vector<double> raw, v_meter;
  long covered = 0, overflow = 0, checked = 0, violations = 0;
  double worst_ratio = 0.0;
  std::vector<attn::MeterCell> cells = cache.cells();
  std::int64_t first = prompt_len;
  if (std::none_of(cells.begin(), cells.end(), [&](const attn::MeterCell& c) { return c.pos >= first; })) first = 0;
  for (const attn::MeterCell& c : cells) {
    if (c.pos < first) continue;
    raw.push_back(c.eform_raw);
    v_meter.push_back(c.v_meter);
    covered += c.meter <= args.coverage_tau;
    overflow += std::isinf(c.eform_raw);
    if (!std::isnan(c.tv)) {
      ++checked;
      if (!(c.tv <= c.meter * (1 + 1e-9) + 1e-12)) ++violations;
      if (c.meter > 0) worst_ratio = std::max(worst_ratio, c.tv / c.meter);
    }
  }
  const std::size_t n = raw.size();
  const cache::KvStore& st = cache.store();
  const double k_bytes = st.bytes_per_token_head(quant::KvSide::key), v_bytes = st.bytes_per_token_head(quant::KvSide::value);
  const double per_token = (k_bytes + v_bytes) * cfg.layers * cfg.kv_heads;
  const double fp16_per_token = 2.0 * 2 * cfg.head_dim * cfg.layers * cfg.kv_heads;
  err << fmt::format("meter: K {} / V {}: {} (layer, query head, {}) cells\n", st.config().k_format,
                     st.config().v_format, n, first == 0 ? "prompt position" : "decode step");
  if (n > 0) {
    err << fmt::format("  coverage at tau={}: {:.4f}   raw score median {:.4g}, max {:.4g}, overflow {:.2f}%\n", args.coverage_tau,
                       static_cast<double>(covered) / n, median(raw), *std::max_element(raw.begin(), raw.end()),
                       100.0 * overflow / n);
    err << fmt::format("  V meter median {:.4g}\n", median(v_meter));
  }
  err << fmt::format("  KV bytes per token: {:.0f} (K {:.2f} + V {:.2f} per head; fp16 {:.0f}: {:.2f}x capacity)\n",
                     per_token, k_bytes, v_bytes, fp16_per_token, fp16_per_token / per_token);
  if (args.check_soundness)
    err << fmt::format("  soundness: {} cells checked against the true TV from the exact tier: {} violations, worst TV/meter {:.4g}\n",
                       checked, violations, worst_ratio);
  if (st.config().k_format == cache::kDitherInt8)
    err << "  (Tier B is a certificate for non-adaptive queries; free-running decoding is outside its theorem)\n";
}

}  // namespace

int run_generate(const GenerateArgs& args, std::ostream& out, std::ostream& err) {
  Engine engine = Engine::load(args.model.empty() ? default_model_path() : args.model);
  const std::vector<std::int32_t> prompt = engine.prompt_tokens(args.prompt, args.chat);
  const model::LlamaConfig& cfg = engine.model->config();
  if (static_cast<std::int64_t>(prompt.size()) > cfg.context)
    throw std::out_of_range("the prompt has " + std::to_string(prompt.size()) + " tokens, more than the model's context of " +
                            std::to_string(cfg.context));
  const std::int64_t capacity = std::min<std::int64_t>(cfg.context, static_cast<std::int64_t>(prompt.size()) + args.n);
  if (!(args.coverage_tau > 0.0)) throw std::invalid_argument("--tau must be positive");
  std::unique_ptr<attn::KvCache> cache_owner;
  attn::CertifiedKvCache* certified = nullptr;
  if (args.kv_k.empty()) {
    cache_owner = std::make_unique<attn::ExactKvCache>(cfg.kv_geometry(capacity));
  } else {
    cache::CacheConfig cc = cfg.cache_config(capacity, args.kv_k, args.kv_v);
    cc.page_size = args.page_size;
    cc.outlier_pairs = args.outliers;
    cc.seed = args.dither_seed;
    cc.dither = args.shared_page_dither ? cache::DitherMode::shared_page : cache::parse_dither_mode(args.dither);
    cc.backing_file = args.backing_file;
    attn::CertifiedOptions opts;
    opts.q_heads = cfg.heads;
    opts.delta_req = args.delta;
    opts.decode_budget = std::max(1, args.n);
    opts.check_soundness = args.check_soundness;
    auto c = std::make_unique<attn::CertifiedKvCache>(cc, opts);
    certified = c.get();
    cache_owner = std::move(c);
  }
  attn::KvCache& cache = *cache_owner;
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
  if (certified) {
    summarize(*certified, args, r.prompt_tokens, cfg, err);
    if (!args.meter_json.empty()) {
      std::ofstream f(args.meter_json);
      if (!f) throw std::runtime_error("cannot write '" + args.meter_json + "'");
      for (const attn::MeterCell& c : certified->cells())
        f << nlohmann::json{{"layer", c.layer}, {"head", c.q_head}, {"pos", c.pos}, {"raw", json_number(c.eform_raw)},
                            {"meter", json_number(c.meter)}, {"v_meter", json_number(c.v_meter)},
                            {"tv", json_number(c.tv)}}.dump()
          << "\n";
    }
  }
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
