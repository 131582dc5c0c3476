#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "apps/engine.h"
#include "apps/run.h"
#include "gate/certified_cache.h"
#include "attn/exact_cache.h"
#include "gate/telemetry.h"
#include "model/generate.h"

namespace witcert::apps {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// The meter summary of a run: its decode-step cells, as the telemetry aggregated them.
void summarize(const gate::CertifiedKvCache& cache, const gate::Telemetry& tel, const GenerateArgs& args,
               const model::LlamaConfig& cfg, std::ostream& err) {
  const gate::TelemetrySummary s = tel.summary();
  const std::vector<gate::MeterCell> cells = tel.samples();
  std::vector<double> v_meter;
  double worst_ratio = 0.0;
  for (const gate::MeterCell& c : cells) {
    v_meter.push_back(c.v_meter);
    if (!std::isnan(c.tv) && c.meter > 0) worst_ratio = std::max(worst_ratio, c.tv / c.meter);
  }
  const cache::KvStore& st = cache.store();
  const double k_bytes = st.bytes_per_token_head(quant::KvSide::key), v_bytes = st.bytes_per_token_head(quant::KvSide::value);
  const double per_token = (k_bytes + v_bytes) * cfg.layers * cfg.kv_heads;
  const double fp16_per_token = 2.0 * 2 * cfg.head_dim * cfg.layers * cfg.kv_heads;
  err << fmt::format("meter: K {} / V {}, bound {}: {} (layer, query head, decode step) cells\n", st.config().k_format.name(),
                     st.config().v_format.name(), cert::bound_shape_label(s.bound), s.cells);
  if (s.cells > 0) {
    err << fmt::format("  coverage at tau_K={} tau_V={}: joint {:.4f}, K {:.4f}, V {:.4f}, e-form K {:.4f}\n", s.tau_k,
                       s.tau_v, s.coverage.joint, s.coverage.k, s.coverage.v, s.coverage.eform);
    err << fmt::format("  raw score median {:.4g}, max {:.4g}, overflow {:.2f}%; V meter median {:.4g}\n", s.raw_p50,
                       s.raw_max, 100.0 * s.overflow / s.cells, median(v_meter));
  }
  if (args.gate > 0.0) {
    const cache::KvStore::PageInStats pi = st.page_in_stats();
    err << fmt::format("  gate tau_K={} tau_V={} {}: joint coverage before repair {:.4f}; {} cells repaired, {} pages "
                       "({:.1f} KiB) paged in\n",
                       args.gate, args.tau_v, args.granularity, s.coverage_before.joint, s.repaired, pi.page_ins,
                       pi.page_in_bytes / 1024.0);
  }
  err << fmt::format("  KV bytes per token: {:.0f} (K {:.2f} + V {:.2f} per head; fp16 {:.0f}: {:.2f}x capacity)\n",
                     per_token, k_bytes, v_bytes, fp16_per_token, fp16_per_token / per_token);
  if (args.check_soundness)
    err << fmt::format("  soundness: {} cells checked against the true TV from the exact tier: {} violations, worst TV/meter {:.4g}\n",
                       s.checked, s.violations, worst_ratio);
  if (st.config().k_format.kind() == quant::FormatKind::dither_int8)
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
  const std::string model_path = args.model.empty() ? default_model_path() : args.model;
  if (!(args.coverage_tau > 0.0) || !std::isfinite(args.coverage_tau))
    throw std::invalid_argument("--coverage-tau must be finite and positive");
  if (!(args.gate >= 0.0) || !std::isfinite(args.gate)) throw std::invalid_argument("--gate must be finite and positive");
  Engine engine = Engine::load(model_path);
  const std::vector<std::int32_t> prompt = engine.prompt_tokens(args.prompt, args.chat);
  const model::LlamaConfig& cfg = engine.model->config();
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
  if (static_cast<std::int64_t>(prompt.size()) > cfg.context)
    throw std::out_of_range("the prompt has " + std::to_string(prompt.size()) + " tokens, more than the model's context of " +
                            std::to_string(cfg.context));
  const std::int64_t capacity = std::min<std::int64_t>(cfg.context, static_cast<std::int64_t>(prompt.size()) + args.n);
  std::unique_ptr<attn::KvCache> cache_owner;
  std::unique_ptr<gate::Telemetry> tel;
  gate::CellLog log;  // every cell, for --meter-json
  gate::CertifiedKvCache* certified = nullptr;
  if (args.kv_k.empty()) {
    cache_owner = std::make_unique<attn::ExactKvCache>(cfg.kv_geometry(capacity));
  } else {
    cache::CacheConfig cc = cfg.cache_config(capacity, quant::KvFormat::parse(args.kv_k),
                                             quant::KvFormat::parse(args.kv_v.empty() ? args.kv_k : args.kv_v));
    cc.page_size = args.page_size;
    cc.outlier_pairs = args.outliers;
    cc.seed = args.dither_seed;
    cc.dither = args.shared_page_dither ? cache::DitherMode::shared_page : cache::parse_dither_mode(args.dither);
    gate::CertifiedOptions opts;
    opts.q_heads = cfg.heads;
    opts.delta_req = args.delta;
    opts.decode_budget = std::max(1, args.n);
    opts.check_soundness = args.check_soundness;
    opts.bound = cert::parse_bound_shape(args.bound);
    opts.gate = {args.gate, gate::parse_granularity(args.granularity), args.tau_v};
    cc.backing = backing_place(args.backing_file, args.backing_file_overwrite, args.keep_backing_file, args.exact_tier,
                               model_path, opts.gate.on() || opts.check_soundness);
    // The telemetry aggregates the decode-step cells; every cell is kept only for --meter-json.
    tel = std::make_unique<gate::Telemetry>(
        cfg.layers, cfg.heads,
        gate::Telemetry::Options{args.coverage_tau, args.tau_v, opts.bound, static_cast<std::int64_t>(prompt.size()), 1});
    opts.sinks = {tel.get()};
    if (!args.meter_json.empty()) opts.sinks.push_back(&log);
    auto c = std::make_unique<gate::CertifiedKvCache>(cc, opts);
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
    summarize(*certified, *tel, args, cfg, err);
    if (!args.meter_json.empty()) write_meter_json(args.meter_json, log.cells());
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
