// Below 8 bits (`witcert eval below8`): the capacity–coverage curve of the dithered formats. For
// B ∈ {4, 5, 6, 8} bits, outlier budgets m ∈ {0, 4} and keys alone (fp16 values, the keys' scales
// per token or per channel and 256-token block) or keys and values dithered (each value with its
// own dither and the values' Tier-B bound): the bytes per token measured from the pool, the
// capacity against fp16, the joint coverage at τ_K 0.2 / τ_V 0.05 on prose and code, the raw
// score's quantiles, a gate's page-in, teacher-forced KL against fp16 raw and gated, needle
// accuracy, and every cell checked against the exact tier. Like dither-int8, the certificate is stated for non-adaptive queries
// (docs/tier-b.md).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "apps/eval/internal.h"
#include "apps/report/run.h"

namespace witcert::apps::eval {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Arm {
  int bits, m;
  bool values;  // the values dithered too, per slot (else fp16 values and the default dither mode)
  formats::ScaleGranularity scales = formats::ScaleGranularity::token;
  std::string key() const {
    return fmt::format("int{}-m{}-{}{}", bits, m, values ? "KV-per-slot" : "K",
                       scales == formats::ScaleGranularity::channel ? "-channel" : "");
  }
  std::string kv() const { return fmt::format("dither-int{}", bits); }
  engine::CacheOptions cache(bool gated) const {
    nlohmann::json j = {{"kv", kv()}, {"kv_v", values ? kv() : "fp16"}, {"outliers", m},
                        {"key_scales", formats::scale_granularity_name(scales)}};
    if (values) j["dither"] = "per-slot";  // the values' own dither, which their Tier-B bound needs
    engine::CacheOptions c = engine::CacheOptions::from_json(j);
    c.check_soundness = true;
    if (gated) c.gate = gate::Policy::from_tau_k(kTauK, gate::Granularity::block, kTauV);
    return c;
  }
};

// One domain's runs of an arm, raw and gated, against the prompts' fp16 references.
json run_domain(const engine::Model& m, const EvalOptions& o, const Arm& arm,
                const std::vector<std::vector<std::int32_t>>& prompts, const std::vector<Fp16Reference>& refs, int n) {
  double cells = 0, joint = 0, k = 0, v = 0, kl = 0, kl_gated = 0, p50 = 0, p99 = 0, page_ins = 0, bytes = 0;
  std::int64_t checked = 0, violations = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    RunConfig raw_cfg{arm.key(), arm.cache(false)}, gated_cfg{arm.key() + " gated", arm.cache(true)};
    const RunOutcome raw = run_request(m, prompts[i], n, raw_cfg, o.threads, refs[i]);
    const RunOutcome gated = run_request(m, prompts[i], n, gated_cfg, o.threads, refs[i]);
    const double c = static_cast<double>(raw.meter.cells);
    cells += c;
    joint += raw.meter.coverage.joint * c, k += raw.meter.coverage.k * c, v += raw.meter.coverage.v * c;
    const double share = 1.0 / static_cast<double>(prompts.size());
    kl += raw.kl * share, kl_gated += gated.kl * share;
    p50 += raw.meter.raw_p50 * share, p99 = std::max(p99, raw.meter.raw_p99);
    page_ins += static_cast<double>(gated.page_ins) * share;
    bytes = raw.kv_bytes_per_token;
    checked += raw.meter.checked + gated.meter.checked;
    violations += raw.meter.violations + gated.meter.violations;
  }
  return {{"joint", cells > 0 ? joint / cells : 0.0}, {"k", cells > 0 ? k / cells : 0.0}, {"v", cells > 0 ? v / cells : 0.0},
          {"kl", kl}, {"kl_gated", kl_gated}, {"raw_p50", p50}, {"raw_p99", p99}, {"page_ins", page_ins},
          {"kv_bytes_per_token", bytes}, {"cells_checked", checked}, {"violations", violations}};
}

// Needle accuracy of a cache (raw; the default options: fp16) over the prompts, with its decode
// steps checked.
json run_needles(const engine::Model& m, ThreadPool& pool, const std::vector<NeedlePrompt>& needles, int n,
                 const engine::CacheOptions& c) {
  int correct = 0;
  std::int64_t checked = 0, violations = 0;
  for (const NeedlePrompt& p : needles) {
    const std::vector<std::int32_t> prompt = m.prompt_tokens(p.text, true);
    SoundnessSink sound(static_cast<std::int64_t>(prompt.size()));
    const CheckedRun r = run_checked(m, pool, prompt, n, c, {&sound}, /*stop=*/true,
                                     /*check_prompt=*/false);
    correct += answered(m.tokenizer->decode(r.tokens), p.answer);
    checked += sound.checked, violations += sound.violations;
  }
  return {{"accuracy", needles.empty() ? 0.0 : double(correct) / double(needles.size())},
          {"cells_checked", checked}, {"violations", violations}};
}

}  // namespace

std::int64_t below8(const engine::Model& m, const EvalOptions& o, std::ostream& out, std::ostream& err) {
  const std::string dir = experiment_dir(o, "below8");
  ResultStore store((fs::path(dir) / "results.jsonl").string());
  const int count = o.quick ? 1 : 2, tokens = o.quick ? 64 : 384, n = o.quick ? 8 : 24, needle_count = o.quick ? 2 : 8;
  std::vector<Arm> arms;
  for (int bits : formats::kDitherBits)
    for (int budget : {0, 4})
      for (bool values : {false, true}) {
        arms.push_back({bits, budget, values});
        if (!values) arms.push_back({bits, budget, false, formats::ScaleGranularity::channel});
      }
  const std::map<std::string, std::vector<std::string>> texts = {
      {"prose", domain_prompts(m, o, "prose", count, tokens, 83)}, {"code", domain_prompts(m, o, "code", count, tokens, 89)}};
  const std::vector<NeedlePrompt> needles = needle_prompts(m, needle_count, o.quick ? 64 : 128, o.quick ? 96 : 320, 97);
  ThreadPool pool(o.threads);
  // The fp16 references, prefilled once per prompt for every arm.
  std::map<std::string, std::vector<std::vector<std::int32_t>>> prompts;
  std::map<std::string, std::vector<Fp16Reference>> refs;
  const auto prepare = [&] {
    if (!refs.empty()) return;
    for (const auto& [domain, list] : texts)
      for (const std::string& t : list) {
        prompts[domain].push_back(m.prompt_tokens(t, false));
        refs[domain].push_back(run_fp16(m, prompts[domain].back(), n, o.threads));
      }
  };
  EtaBar bar(err, "below8", static_cast<std::int64_t>(arms.size()) + 1);
  if (store.has("fp16")) {
    bar.skip();
  } else {
    store.put("fp16", {{"needle", run_needles(m, pool, needles, n, {})}});
    bar.advance();
  }
  for (const Arm& arm : arms) {
    if (store.has(arm.key())) {
      bar.skip();
      continue;
    }
    prepare();
    json rec = {{"bits", arm.bits}, {"m", arm.m}, {"values", arm.values},
                {"key_scales", formats::scale_granularity_name(arm.scales)}};
    for (const auto& [domain, list] : prompts) rec[domain] = run_domain(m, o, arm, list, refs.at(domain), n);
    rec["needle"] = run_needles(m, pool, needles, n, arm.cache(false));
    store.put(arm.key(), rec);
    bar.advance();
  }
  bar.finish();

  const model::LlamaConfig& cfg = m.model->config();
  const double fp16_bytes = 2.0 * 2 * cfg.head_dim * cfg.layers * cfg.kv_heads;  // K and V of a token, every layer and head
  std::vector<json> rows;
  std::int64_t total_bad = 0, checked = 0;
  std::string smallest_k, smallest_kv;
  for (const Arm& arm : arms) {
    const json& r = store.get(arm.key());
    const json &prose = r.at("prose"), &code = r.at("code"), &needle = r.at("needle");
    const std::int64_t bad = prose.at("violations").get<std::int64_t>() + code.at("violations").get<std::int64_t>() +
                             needle.at("violations").get<std::int64_t>();
    total_bad += bad;
    checked += prose.at("cells_checked").get<std::int64_t>() + code.at("cells_checked").get<std::int64_t>() +
               needle.at("cells_checked").get<std::int64_t>();
    const double bytes = prose.at("kv_bytes_per_token").get<double>();
    const double capacity = fp16_bytes / bytes;
    if (arm.m == 4 && arm.scales == formats::ScaleGranularity::token && prose.at("joint").get<double>() >= 0.9) {
      std::string& smallest = arm.values ? smallest_kv : smallest_k;
      if (smallest.empty()) smallest = fmt::format("{} ({:.2f}x fp16)", arm.kv(), capacity);
    }
    rows.push_back({{"format", arm.kv()},
                    {"m", arm.m},
                    {"key scales", formats::scale_granularity_name(arm.scales)},
                    {"values", arm.values ? arm.kv() + " per-slot" : "fp16"},
                    {"bytes/token", bytes},
                    {"capacity x fp16", capacity},
                    {"joint coverage prose", prose.at("joint")},
                    {"joint coverage code", code.at("joint")},
                    {"V coverage prose", prose.at("v")},
                    {"raw p50 prose", prose.at("raw_p50")},
                    {"raw p99 prose", prose.at("raw_p99")},
                    {"KL/tok raw", prose.at("kl")},
                    {"KL/tok gated", prose.at("kl_gated")},
                    {"gated page-ins", prose.at("page_ins")},
                    {"needle accuracy", needle.at("accuracy")},
                    {"cells checked", prose.at("cells_checked").get<std::int64_t>() +
                                          code.at("cells_checked").get<std::int64_t>() +
                                          needle.at("cells_checked").get<std::int64_t>()},
                    {"violations", bad}});
  }
  write_table(dir, "below8",
              {"format", "m", "key scales", "values", "bytes/token", "capacity x fp16", "joint coverage prose", "joint coverage code",
               "V coverage prose", "raw p50 prose", "raw p99 prose", "KL/tok raw", "KL/tok gated", "gated page-ins",
               "needle accuracy", "cells checked", "violations"},
              rows,
              fmt::format("Dithered formats below 8 bits: {} prose and {} code prompts of {} tokens, {} decode steps, "
                          "{} needle prompts (fp16 answers {:.2f}); joint coverage at tau_K {} / tau_V {}, gate at the "
                          "same thresholds (block); KL teacher-forced against fp16 on prose; bytes measured from the "
                          "pool, every layer and KV head, K and V; key scales per token (32 channels) or per channel "
                          "(256-token blocks; a key is exact until its block is complete, the prompt's last block ending "
                          "with it, so the decode steps' own keys are exact there). Smallest B with prose joint coverage "
                          ">= 0.9 at m = 4 (token scales): keys {}, keys and values {}. Certificates hold for "
                          "non-adaptive queries",
                          count, count, tokens, n, needle_count, store.get("fp16").at("needle").at("accuracy").get<double>(),
                          kTauK, kTauV, smallest_k.empty() ? "none" : smallest_k,
                          smallest_kv.empty() ? "none" : smallest_kv));
  out << fmt::format("below8: {} cells checked against the exact tier\n", checked);
  finish(o, "below8", dir, out, total_bad);
  return total_bad;
}

}  // namespace witcert::apps::eval
