// Needle retrieval at scale (Table 18, Figs. 4, 5, 7) and the danger rate against accuracy
// (Fig. 6). Seeded needle prompts run on fp16 and on each scheme raw and gated; accuracy is
// paired against fp16 per prompt (bootstrap interval, McNemar's test).
#include <fmt/format.h>

#include <filesystem>
#include <numeric>

#include "apps/eval/internal.h"

namespace witcert::apps::eval {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// One configuration of a needle request: fp16, or a scheme raw (tau 0) or gated.
struct Config {
  std::string label, kv;
  double tau = 0.0;
  gate::Granularity granularity = gate::Granularity::block;
  int prompts = 0;  // runs on the first `prompts` prompts only; 0: every one
};

// Runs one configuration on one prompt: whether it answered, its page-in bytes, coverage, and
// soundness (with the danger count of its decode steps).
json run_config(const engine::Model& m, ThreadPool& pool, const std::vector<std::int32_t>& prompt,
                const NeedlePrompt& p, int n, const Config& cfg) {
  engine::CacheOptions c;
  if (!cfg.kv.empty()) c = checked_cache(cfg.kv);
  if (cfg.tau > 0) c.gate = gate::Policy::from_tau_k(cfg.tau, cfg.granularity, kTauV);
  const std::int64_t first = static_cast<std::int64_t>(prompt.size());
  CoverageSink cov(first, kTauK, kTauV);
  SoundnessSink sound(first);
  const CheckedRun r = run_checked(m, pool, prompt, n, c, {&cov, &sound}, /*stop=*/true, /*check_prompt=*/false);
  const std::string text = m.tokenizer->decode(r.tokens);
  return {{"correct", answered(text, p.answer)},
          {"text", text},
          {"page_in_bytes", r.page_in.page_in_bytes},
          {"coverage", cfg.kv.empty() ? 1.0 : cov.served()},
          {"danger", sound.decode_checked ? double(sound.dangerous) / double(sound.decode_checked) : 0.0},
          {"cells_checked", sound.checked},
          {"violations", sound.violations}};
}

// Runs every configuration on every prompt, one stored record per prompt.
void run_prompts(const engine::Model& m, const EvalOptions& o, ResultStore& store, const std::string& label,
                 const std::vector<NeedlePrompt>& prompts, const std::vector<Config>& configs, int n, std::ostream& err) {
  ThreadPool pool(o.threads);
  EtaBar bar(err, label, static_cast<std::int64_t>(prompts.size()));
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const std::string key = fmt::format("p{}", i);
    if (store.has(key)) {
      bar.skip();
      continue;
    }
    const std::vector<std::int32_t> prompt = m.prompt_tokens(prompts[i].text, true);
    json rec = {{"prompt_tokens", prompt.size()}, {"depth", prompts[i].depth}, {"answer", prompts[i].answer}};
    for (const Config& c : configs)
      if (c.prompts == 0 || static_cast<int>(i) < c.prompts) rec[c.label] = run_config(m, pool, prompt, prompts[i], n, c);
    store.put(key, rec);
    bar.advance();
  }
  bar.finish();
}

}  // namespace

std::int64_t needle(const engine::Model& m, const EvalOptions& o, std::ostream& out, std::ostream& err) {
  const std::string dir = experiment_dir(o, "needle");
  ResultStore store((fs::path(dir) / "results.jsonl").string());
  const int count = o.quick ? 2 : 200, n = 20, min_tokens = o.quick ? 64 : 96, max_tokens = o.quick ? 96 : 192;
  // τ = 1 and head-granular paging (against block) on the first prompts only: the two-hour budget.
  const int sweep_prompts = o.quick ? 2 : 40;
  // The paper's Table 18 schemes: fp8 (broken raw), kivi-2bit (a silent tail), rtn-int8 (safe).
  const std::vector<std::string> schemes =
      o.quick ? std::vector<std::string>{"kivi-2bit"} : std::vector<std::string>{"fp8-e4m3", "kivi-2bit", "rtn-int8"};
  std::vector<Config> configs = {{"fp16", "", 0.0}};
  for (const std::string& s : schemes) {
    configs.push_back({s + " raw", s, 0.0});
    configs.push_back({s + " gate 0.2", s, 0.2});
    configs.push_back({s + " gate 1", s, 1.0, gate::Granularity::block, sweep_prompts});
    configs.push_back({s + " gate 5", s, 5.0});
    configs.push_back({s + " gate 0.2 head", s, 0.2, gate::Granularity::head, sweep_prompts});
  }
  const std::vector<NeedlePrompt> prompts = needle_prompts(m, count, min_tokens, max_tokens, 61);
  run_prompts(m, o, store, "needle", prompts, configs, n, err);

  std::vector<double> base;
  for (int i = 0; i < count; ++i) base.push_back(store.get(fmt::format("p{}", i)).at("fp16").at("correct").get<bool>());
  std::vector<json> rows, traffic;
  std::int64_t total_bad = 0;
  for (const Config& c : configs) {
    std::vector<double> correct, page_in, coverage;
    std::int64_t b01 = 0, b10 = 0, checked = 0, bad = 0;
    const int runs = c.prompts == 0 ? count : std::min(count, c.prompts);
    for (int i = 0; i < runs; ++i) {
      const json& r = store.get(fmt::format("p{}", i)).at(c.label);
      const bool ok = r.at("correct").get<bool>();
      correct.push_back(ok);
      b01 += !base[i] && ok, b10 += base[i] && !ok;
      page_in.push_back(r.at("page_in_bytes").get<double>() / 1024);
      coverage.push_back(r.at("coverage").get<double>());
      checked += r.at("cells_checked").get<std::int64_t>(), bad += r.at("violations").get<std::int64_t>();
    }
    total_bad += bad;
    double acc = 0, cov = 0;
    for (std::size_t i = 0; i < correct.size(); ++i) acc += correct[i], cov += coverage[i];
    acc /= runs, cov /= runs;
    // Paired against fp16 on the same prompts.
    const std::vector<double> base_runs(base.begin(), base.begin() + runs);
    const auto [lo, hi] = paired_bootstrap_ci(base_runs, correct, 10000, 7);
    const double base_acc = std::accumulate(base_runs.begin(), base_runs.end(), 0.0) / runs;
    if (c.granularity == gate::Granularity::head) {
      const std::string block = fmt::format("{} gate 0.2", c.kv);
      std::vector<double> block_kib;
      for (int i = 0; i < runs; ++i)
        block_kib.push_back(store.get(fmt::format("p{}", i)).at(block).at("page_in_bytes").get<double>() / 1024);
      traffic.push_back({{"scheme", c.kv}, {"prompts", runs}, {"block P50 KiB", percentile(block_kib, 0.5)},
                         {"block P95 KiB", percentile(block_kib, 0.95)}, {"head P50 KiB", percentile(page_in, 0.5)},
                         {"head P95 KiB", percentile(page_in, 0.95)}, {"head accuracy", acc}});
      continue;
    }
    rows.push_back({{"configuration", c.label},
                    {"gate", c.tau == 0 ? "–" : c.tau < 1 ? "certified" : "risk-ranked"}, {"prompts", runs},
                    {"accuracy", acc}, {"fp16 on them", base_acc}, {"vs fp16", acc - base_acc},
                    {"95% CI low", lo}, {"95% CI high", hi}, {"McNemar p", mcnemar_p(b01, b10)},
                    {"coverage at 0.2", cov}, {"page-in P50 KiB", percentile(page_in, 0.5)},
                    {"page-in P95 KiB", percentile(page_in, 0.95)}, {"cells checked", checked}, {"violations", bad}});
  }
  write_table(dir, "needle",
              {"configuration", "gate", "prompts", "accuracy", "fp16 on them", "vs fp16", "95% CI low", "95% CI high", "McNemar p",
               "coverage at 0.2", "page-in P50 KiB", "page-in P95 KiB", "cells checked", "violations"},
              rows,
              fmt::format("Needle retrieval: {} seeded prompts ({} to {} haystack tokens, needle depth 0.1 to 0.9), "
                          "greedy, up to {} new tokens; accuracy paired against fp16 (bootstrap 10^4, McNemar exact); "
                          "coverage of the decode steps as served, K and V; {}",
                          count, min_tokens, max_tokens, n, bound_caption(checked_cache(schemes.front()).bound)));
  write_table(dir, "traffic", {"scheme", "prompts", "block P50 KiB", "block P95 KiB", "head P50 KiB", "head P95 KiB", "head accuracy"},
              traffic, "Page-in per request of a certified gate (tau = 0.2): pages in block order against whole heads");
  finish(o, "needle", dir, out, total_bad);
  return total_bad;
}

std::int64_t danger(const engine::Model& m, const EvalOptions& o, std::ostream& out, std::ostream& err) {
  const std::string dir = experiment_dir(o, "danger");
  ResultStore store((fs::path(dir) / "results.jsonl").string());
  const int count = o.quick ? 1 : 24, n = 20;
  std::vector<Config> configs = {{"fp16", "", 0.0}};
  const std::vector<std::string> all = metered_schemes();
  // The quick run: one Tier A scheme, one 2-bit scheme and Tier B.
  for (const std::string& s : all)
    if (!o.quick || s == "q8_0" || s == "kivi-2bit" || s == "dither-int8") configs.push_back({s, s, 0.0});
  const std::vector<NeedlePrompt> prompts = needle_prompts(m, count, o.quick ? 64 : 96, o.quick ? 96 : 256, 71);
  run_prompts(m, o, store, "danger", prompts, configs, n, err);
  std::vector<json> rows;
  std::int64_t total_bad = 0;
  for (const Config& c : configs) {
    double acc = 0, danger = 0, cov = 0;
    std::int64_t checked = 0, bad = 0;
    for (int i = 0; i < count; ++i) {
      const json& r = store.get(fmt::format("p{}", i)).at(c.label);
      acc += r.at("correct").get<bool>(), danger += r.at("danger").get<double>(), cov += r.at("coverage").get<double>();
      checked += r.at("cells_checked").get<std::int64_t>(), bad += r.at("violations").get<std::int64_t>();
    }
    total_bad += bad;
    rows.push_back({{"scheme", c.label}, {"danger rate (TV > 0.2)", c.kv.empty() ? json(0.0) : json(danger / count)},
                    {"needle accuracy", acc / count}, {"coverage at 0.2", cov / count}, {"cells checked", checked},
                    {"violations", bad}});
  }
  write_table(dir, "danger", {"scheme", "danger rate (TV > 0.2)", "needle accuracy", "coverage at 0.2", "cells checked", "violations"},
              rows,
              fmt::format("Danger rate (fraction of decode-step cells with true TV > 0.2) against needle accuracy, "
                          "raw caches, {} seeded needle prompts; {}",
                          count, bound_caption(checked_cache(all.front()).bound)));
  finish(o, "danger", dir, out, total_bad);
  return total_bad;
}

}  // namespace witcert::apps::eval
