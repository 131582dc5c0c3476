#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>

#include "apps/cli/commands.h"
#include "apps/report/run.h"
#include "attention/cpu/exact_cache.h"
#include "engine/cache_factory.h"
#include "engine/model.h"
#include "engine/batch.h"
#include "engine/meter_object.h"
#include "engine/session.h"
#include "kvcache/kv_store.h"
#include "gate/telemetry.h"

namespace witcert::apps {
namespace {

// The meter summary of a run: its decode-step cells, as the telemetry aggregated them.
// st: a store of the run's formats (its bytes per token and settings).
void summarize(const kvcache::KvStore& st, const engine::BatchResult& r, const engine::CacheOptions& opts,
               const model::LlamaConfig& cfg, std::ostream& err) {
  const gate::TelemetrySummary& s = r.meter;
  const double k_bytes = st.bytes_per_token_head(formats::KvSide::key), v_bytes = st.bytes_per_token_head(formats::KvSide::value);
  const double per_token = (k_bytes + v_bytes) * cfg.layers * cfg.kv_heads;
  const double fp16_per_token = 2.0 * 2 * cfg.head_dim * cfg.layers * cfg.kv_heads;
  err << fmt::format("meter: K {} / V {}, bound {}: {} (layer, query head, decode step) cells\n", st.config().k_format.name(),
                     st.config().v_format.name(), cert::bound_shape_label(s.bound), s.cells);
  err << fmt::format("  verdict: {} ({})\n", gate::verdict_name(s.verdict()), s.reason());
  if (s.cells > 0) {
    err << fmt::format("  coverage at tau_K={} tau_V={}: joint {:.4f}, K {:.4f}, V {:.4f}, e-form K {:.4f}\n", s.tau_k,
                       s.tau_v, s.coverage.joint, s.coverage.k, s.coverage.v, s.coverage.eform);
    err << fmt::format("  raw score median {:.4g}, max {:.4g}, overflow {:.2f}%; V meter median {:.4g}\n", s.raw_p50,
                       s.raw_max, 100.0 * s.overflow / s.cells, s.v_meter_p50);
  }
  if (opts.gate.on()) {
    err << fmt::format("  gate tau_K={} tau_V={} {}: joint coverage before repair {:.4f}; {} cells repaired, {} pages "
                       "({:.1f} KiB) paged in\n",
                       opts.gate.tau_k(), opts.gate.tau_v, gate::granularity_name(opts.gate.granularity), s.coverage_before.joint, s.repaired, r.page_ins,
                       r.page_in_bytes / 1024.0);
  }
  err << fmt::format("  KV bytes per token: {:.0f} (K {:.2f} + V {:.2f} per head; fp16 {:.0f}: {:.2f}x capacity)\n",
                     per_token, k_bytes, v_bytes, fp16_per_token, fp16_per_token / per_token);
  if (opts.check_soundness)
    err << fmt::format("  soundness: {} cells checked against the true TV from the exact tier: {} violations, worst TV/meter {:.4g}\n",
                       s.checked, s.violations, s.worst_tv_ratio);
  if (st.config().k_format.kind() == formats::FormatKind::dither && st.config().dither == kvcache::DitherMode::none)
    err << "  (keys rounded without dither: their bound is deterministic, for any query)\n";
  else if (st.config().k_format.kind() == formats::FormatKind::dither)
    err << "  (Tier B is a certificate for non-adaptive queries; free-running decoding is outside its theorem)\n";
}

// Writes every kept cell (prompt positions included) as JSON lines.
void write_meter_json(const std::string& path, const std::vector<gate::MeterCell>& cells) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write '" + path + "'");
  gate::write_cells_jsonl(f, cells);
}

}  // namespace

int run_generate(const GenerateArgs& args, std::ostream& out, std::ostream& err) {
  const std::string model_path = args.model.empty() ? engine::default_model_path() : args.model;
  const engine::CacheOptions cache_opts = cache_options(args.cache, args.cache.kv, model_path);
  engine::Model engine = engine::Model::load(model_path);
  const std::vector<std::int32_t> prompt = engine.checked_prompt(args.prompt, args.chat);
  const model::LlamaConfig& cfg = engine.model->config();
  // The run's every cell (prompt positions included) is kept only for --meter-json.
  gate::CellLog log;
  engine::BatchRequest req;
  req.prompt = prompt;
  req.max_tokens = args.n;
  req.sampler = {args.temperature, args.top_p, args.seed, args.top_k};
  req.cache = cache_opts;
  req.coverage_tau = args.cache.coverage_tau;
  req.coverage_tau_v = args.cache.tau_v;
  if (!args.meter_json.empty()) req.sinks.push_back(&log);
  ThreadPool pool(args.threads);

  // Prefill: until the first token is sampled; decode: from there to the end, over the forward
  // passes after the first sample.
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  std::optional<Clock::time_point> first;
  const engine::BatchResult r = engine::run_alone(*engine.model, pool, req, engine.stop_tokens(),
                                                  [&](std::int32_t t, std::span<const float>) {
                                                    if (!first) first = Clock::now();
                                                    if (!args.json) out << engine.tokenizer->token_piece(t) << std::flush;
                                                    return false;
                                                  });
  const Clock::time_point t1 = Clock::now();
  if (args.json) {
    std::string text;
    for (std::int32_t t : r.tokens) text += engine.tokenizer->token_piece(t);
    const nlohmann::json j = {{"text", text},
                              {"prompt_tokens", r.prompt_tokens},
                              {"completion_tokens", r.tokens.size()},
                              {"finish_reason", engine::finish_name(r.finish)},
                              {"witcert", engine::meter_object(cache_opts, r)}};
    out << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  out << "\n";
  const auto seconds = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  const double prefill_seconds = seconds(t0, first.value_or(t1)), decode_seconds = seconds(first.value_or(t1), t1);
  const double decoded = r.tokens.empty() ? 0.0 : static_cast<double>(r.tokens.size()) - (r.finish == engine::Finish::stop ? 0 : 1);
  err << fmt::format("prefill: {} tokens, {:.1f} tok/s; decode: {} tokens, {:.1f} tok/s ({} threads)\n",
                     r.prompt_tokens, r.prompt_tokens / prefill_seconds, r.tokens.size(),
                     decoded > 0 ? decoded / decode_seconds : 0.0, pool.size());
  if (cache_opts.certified) {
    const std::int64_t capacity = std::min<std::int64_t>(cfg.context, static_cast<std::int64_t>(prompt.size()) + args.n);
    summarize(kvcache::KvStore(engine::cache_config(cfg, capacity, cache_opts)), r, cache_opts, cfg, err);
    if (!args.meter_json.empty()) write_meter_json(args.meter_json, log.cells());
  }
  return 0;
}

int run_logits(const LogitsArgs& args, std::ostream& out) {
  engine::Model engine = engine::Model::load(args.model.empty() ? engine::default_model_path() : args.model);
  const std::vector<std::int32_t> prompt = engine.checked_prompt(args.prompt, args.chat);
  const model::LlamaConfig& cfg = engine.model->config();
  if (args.top < 1) throw std::invalid_argument("--top must be at least 1");
  attention::ExactKvCache cache(cfg.kv_geometry(static_cast<std::int64_t>(prompt.size())));
  ThreadPool pool(args.threads);
  engine::Session session(*engine.model, cache, pool);
  const std::span<const float> logits = session.prefill(prompt);
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
