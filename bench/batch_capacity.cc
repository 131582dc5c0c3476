// How many sequences of L tokens one KV memory budget holds, per format, on the real model's
// geometry, measured from allocations: the pool is sized from probe pools (engine::size_pool),
// then built, filled with that many sequences of L written tokens each, and its bytes plus every
// sequence's own bytes are read back and checked against the budget.
//
//   build/witcert_batch_capacity --kv-memory 1G --tokens 4096 [--formats plain,fp16,dither-int8,...]
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/cache_factory.h"
#include "engine/model.h"

namespace {

using namespace witcert;

struct Row {
  std::string name;
  std::int64_t sequences = 0;
  std::size_t measured = 0;  // pool + sequences, after writing
  double bytes_per_token = 0.0;
};

engine::CacheOptions options(const std::string& name, int outliers) {
  engine::CacheOptions o;
  if (name == "plain") return o;
  o.certified = true;
  o.k_format = o.v_format = formats::KvFormat::parse(name);
  o.outliers = outliers;
  return o;
}

// Fills `count` sequences of `tokens` positions in a pool of `pages` pages; returns the measured
// bytes of the pool and the sequences' own state.
std::size_t fill(const model::LlamaConfig& cfg, const engine::CacheOptions& o, std::int64_t tokens, std::int64_t pages,
                 std::int64_t count) {
  const engine::Pool pool = engine::make_pool(cfg, tokens, pages, o, false);
  std::vector<engine::Cache> seqs;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> k(cfg.head_dim), v(cfg.head_dim);
  std::size_t own = 0;
  for (std::int64_t s = 0; s < count; ++s) {
    seqs.push_back(engine::make_sequence_cache(pool, cfg, 128, o));
    for (std::int64_t p = 0; p < tokens; ++p)
      for (int l = 0; l < cfg.layers; ++l)
        for (int h = 0; h < cfg.kv_heads; ++h) {
          for (int i = 0; i < cfg.head_dim; ++i) k[i] = g(rng), v[i] = g(rng);
          seqs.back().kv->write(l, h, p, k.data(), v.data());
        }
    own += seqs.back().certified ? seqs.back().certified->store().sequence().bytes()
                                 : static_cast<std::size_t>((tokens + o.page_size - 1) / o.page_size) * sizeof(std::int64_t);
  }
  return pool.bytes() + own;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Sequences of L tokens per KV memory budget, per format, measured from allocations"};
  std::string model_path, budget_text = "1G", formats_text = "plain,fp16,dither-int8,dither-int8/m0,q8_0,q4_0,fp8-e4m3";
  std::int64_t tokens = 4096;
  app.add_option("--model", model_path, "GGUF model (default: the fetched SmolLM2-135M)");
  app.add_option("--kv-memory", budget_text, "the budget: bytes, or with K, M or G");
  app.add_option("--tokens", tokens, "tokens per sequence")->check(CLI::Range(1, 1 << 20));
  app.add_option("--formats", formats_text, "comma-separated; dither-int8/m0 is dither-int8 without outlier pairs");
  CLI11_PARSE(app, argc, argv);
  try {
    const engine::Model m = engine::Model::load(model_path.empty() ? engine::default_model_path() : model_path);
    const model::LlamaConfig& cfg = m.model->config();
    double budget = std::stod(budget_text);
    const char unit = budget_text.back();
    budget *= unit == 'G' ? 1 << 30 : unit == 'M' ? 1 << 20 : unit == 'K' ? 1 << 10 : 1;
    std::vector<Row> rows;
    std::size_t start = 0;
    while (start <= formats_text.size()) {
      const std::size_t end = std::min(formats_text.find(',', start), formats_text.size());
      const std::string name = formats_text.substr(start, end - start);
      start = end + 1;
      const bool m0 = name == "dither-int8/m0";
      const engine::CacheOptions o = options(m0 ? "dither-int8" : name, m0 ? 0 : 4);
      // The most sequences whose pages and own state fit: size the pool for n, check it holds n.
      const std::int64_t per_seq = (tokens + o.page_size - 1) / o.page_size;
      std::int64_t n = 0;
      for (std::int64_t c = 1;; ++c) {
        const engine::PoolSizing s = engine::size_pool(cfg, tokens, o, static_cast<std::int64_t>(budget), static_cast<int>(c));
        if (s.pages < c * per_seq) break;
        n = c;
      }
      Row r{name, n, 0, 0.0};
      if (n > 0) {
        const engine::PoolSizing s = engine::size_pool(cfg, tokens, o, static_cast<std::int64_t>(budget), static_cast<int>(n));
        r.measured = fill(cfg, o, tokens, s.pages, n);
        if (r.measured > budget) throw std::runtime_error(name + ": measured bytes exceed the budget");
        r.bytes_per_token = static_cast<double>(s.page_bytes) / o.page_size;
      }
      rows.push_back(r);
      std::cerr << name << ": " << n << "\n";
    }
    const double base = rows.empty() || rows[0].sequences == 0 ? 0.0 : static_cast<double>(rows[0].sequences);
    std::cout << fmt::format("| format | sequences of {} tokens | x {} | bytes per token (all layers) | measured bytes |\n",
                             tokens, rows.empty() ? "" : rows[0].name);
    std::cout << "| --- | ---: | ---: | ---: | ---: |\n";
    for (const Row& r : rows)
      std::cout << fmt::format("| {} | {} | {:.2f} | {:.1f} | {} |\n", r.name, r.sequences,
                               base > 0 ? r.sequences / base : 0.0, r.bytes_per_token, r.measured);
    std::cout << fmt::format("\nbudget {} bytes (--kv-memory {}), {} layers x {} KV heads x head_dim {}\n",
                             static_cast<std::int64_t>(budget), budget_text, cfg.layers, cfg.kv_heads, cfg.head_dim);
  } catch (const std::exception& e) {
    std::cerr << "witcert_batch_capacity: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
