// Quality (Tables 9, 16): teacher-forced perplexity, KL and top-1 against fp16 per scheme, and the
// 2×2 dither/RTN × outlier ablation; layer pollution (§6.4.1): kivi-2bit in one layer at a time;
// and the Table 5 control of the outlier bypass.
#include <fmt/format.h>

#include <filesystem>
#include <random>

#include "apps/eval/internal.h"
#include "attention/cpu/exact_cache.h"
#include "cert/meter.h"
#include "cert/subgaussian.h"
#include "engine/cache_factory.h"
#include "engine/session.h"
#include "formats/dither/dither.h"
#include "gate/certified_cache.h"

namespace witcert::apps::eval {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// fp16's log-probabilities of every position of a text, teacher-forced.
std::vector<std::vector<float>> reference_rows(const engine::Model& m, ThreadPool& pool,
                                               const std::vector<std::int32_t>& tokens) {
  attention::ExactKvCache exact(m.model->config().kv_geometry(static_cast<std::int64_t>(tokens.size())));
  engine::Session s(*m.model, exact, pool);
  std::vector<std::vector<float>> rows(tokens.size());
  s.prefill(tokens, {}, [&](std::int64_t pos, std::span<const float> logits) {
    const std::vector<double> lp = engine::log_softmax(logits);
    rows[static_cast<std::size_t>(pos)].assign(lp.begin(), lp.end());
  });
  return rows;
}

// Teacher-forced agreement with fp16 over positions [0, n − 1): mean KL(p_fp16 ‖ p), top-1
// agreement and the NLL of the text's next token.
struct Agreement {
  double kl = 0.0, top1 = 0.0, nll = 0.0;
  std::int64_t positions = 0;
  void add(const std::vector<float>& ref, std::span<const float> logits, std::int32_t next) {
    const std::vector<double> lp = engine::log_softmax(logits);
    double kl_pos = 0.0;
    std::size_t arg_ref = 0, arg = 0;
    for (std::size_t i = 0; i < lp.size(); ++i) {
      const double pr = std::exp(double(ref[i]));
      if (pr > 0) kl_pos += pr * (double(ref[i]) - lp[i]);
      if (ref[i] > ref[arg_ref]) arg_ref = i;
      if (lp[i] > lp[arg]) arg = i;
    }
    kl += std::max(0.0, kl_pos), top1 += arg == arg_ref, nll += -lp[static_cast<std::size_t>(next)];
    ++positions;
  }
  json to_json() const {
    const double p = positions ? double(positions) : 1.0;
    return {{"kl", kl / p}, {"top1", top1 / p}, {"nll", nll / p}, {"positions", positions}};
  }
};

// A cache whose layers run on one of two caches: `polluted` for the chosen layer (every layer when
// layer < 0), the exact cache for the rest.
class LayerMix final : public kvcache::KvCache {
 public:
  LayerMix(std::unique_ptr<kvcache::KvCache> polluted, std::unique_ptr<kvcache::KvCache> exact, int layer)
      : polluted_(std::move(polluted)), exact_(std::move(exact)), layer_(layer) {}
  const kvcache::KvGeometry& geometry() const override { return exact_->geometry(); }
  void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) override {
    at(layer).write(layer, kv_head, pos, k, v);
  }
  using kvcache::KvCache::attend;
  void attend(int layer, int kv_head, const float* q, int group, std::int64_t begin, std::int64_t end,
              float* out) override {
    at(layer).attend(layer, kv_head, q, group, begin, end, out);
  }
  void attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group, std::int64_t pos0,
                     std::int64_t n, std::int64_t window, float* out, std::int64_t out_stride) override {
    at(layer).attend_causal(layer, kv_head, q, q_stride, group, pos0, n, window, out, out_stride);
  }
  kvcache::AttendConcurrency attend_concurrency() const override {
    return std::max(polluted_->attend_concurrency(), exact_->attend_concurrency());
  }
  void clear() override {
    polluted_->clear();
    exact_->clear();
  }
  void set_prompt_length(std::int64_t n) override {
    polluted_->set_prompt_length(n);
    exact_->set_prompt_length(n);
  }

 private:
  kvcache::KvCache& at(int layer) { return layer_ < 0 || layer == layer_ ? *polluted_ : *exact_; }
  std::unique_ptr<kvcache::KvCache> polluted_, exact_;
  int layer_;
};

}  // namespace

std::int64_t quality(const engine::Model& m, const EvalOptions& o, std::ostream& out, std::ostream& err) {
  const std::string dir = experiment_dir(o, "quality");
  ResultStore store((fs::path(dir) / "results.jsonl").string());
  const int windows = o.quick ? 1 : 2, tokens = o.quick ? 48 : 256;
  struct Arm {
    std::string label;
    engine::CacheOptions cache;
  };
  std::vector<Arm> arms;
  for (const std::string& s : metered_schemes()) arms.push_back({s, checked_cache(s)});
  // The 2×2 ablation on dither-int8 keys: dither or round-to-nearest, with m = 0 or 4 outlier pairs.
  for (bool dither : {false, true})
    for (int budget : {0, 4}) {
      Arm a{fmt::format("ablation: {} m={}", dither ? "dither" : "RTN", budget), checked_cache("dither-int8")};
      a.cache.dither = dither ? kvcache::DitherMode::per_slot : kvcache::DitherMode::none;
      a.cache.outliers = budget;
      arms.push_back(a);
    }
  const model::LlamaConfig& cfg = m.model->config();
  ThreadPool pool(o.threads);
  EtaBar bar(err, "quality", 2 * windows);
  for (const std::string domain : {"prose", "code"}) {
    const std::vector<std::string> texts = domain_prompts(m, o, domain, windows, tokens, domain == "prose" ? 81 : 82);
    for (int w = 0; w < windows; ++w) {
      const std::string key = fmt::format("{}/{}", domain, w);
      if (store.has(key)) {
        bar.skip();
        continue;
      }
      const std::vector<std::int32_t> ids = m.prompt_tokens(texts[w], false);
      const std::vector<std::vector<float>> ref = reference_rows(m, pool, ids);
      json rec = {{"domain", domain}, {"tokens", ids.size()}};
      double nll = 0.0;  // fp16's own
      for (std::size_t p = 0; p + 1 < ids.size(); ++p) nll -= ref[p][static_cast<std::size_t>(ids[p + 1])];
      rec["fp16"] = {{"nll", nll / static_cast<double>(ids.size() - 1)}, {"positions", ids.size() - 1}};
      for (const Arm& a : arms) {
        SoundnessSink sound;
        const engine::Cache c = engine::make_cache(cfg, static_cast<std::int64_t>(ids.size()), 1, a.cache, {&sound});
        engine::Session s(*m.model, *c.kv, pool);
        Agreement ag;
        s.prefill(ids, {}, [&](std::int64_t pos, std::span<const float> logits) {
          if (pos + 1 < static_cast<std::int64_t>(ids.size()))
            ag.add(ref[static_cast<std::size_t>(pos)], logits, ids[static_cast<std::size_t>(pos) + 1]);
        });
        json r = ag.to_json();
        r["bytes_per_token_head"] = (c.certified->store().bytes_per_token_head(formats::KvSide::key) +
                                     c.certified->store().bytes_per_token_head(formats::KvSide::value)) / 2.0;
        r["cells_checked"] = sound.checked;
        r["violations"] = sound.violations;
        rec[a.label] = r;
      }
      store.put(key, rec);
      bar.advance();
    }
  }
  bar.finish();
  std::vector<json> rows;
  std::int64_t total_bad = 0;
  for (const Arm& a : arms)
    for (const std::string domain : {"prose", "code"}) {
      double kl = 0, top1 = 0, nll = 0, pos = 0, bytes = 0;
      std::int64_t checked = 0, bad = 0;
      for (int w = 0; w < windows; ++w) {
        const json& r = store.get(fmt::format("{}/{}", domain, w)).at(a.label);
        const double p = r.at("positions").get<double>();
        kl += r.at("kl").get<double>() * p, top1 += r.at("top1").get<double>() * p, nll += r.at("nll").get<double>() * p;
        pos += p;
        bytes = r.at("bytes_per_token_head").get<double>();
        checked += r.at("cells_checked").get<std::int64_t>(), bad += r.at("violations").get<std::int64_t>();
      }
      total_bad += bad;
      rows.push_back({{"cache", a.label}, {"domain", domain}, {"perplexity", std::exp(nll / pos)}, {"KL/token vs fp16", kl / pos},
                      {"top-1 vs fp16", top1 / pos}, {"B/token/head (K+V)/2", bytes}, {"cells checked", checked},
                      {"violations", bad}});
    }
  // fp16's own perplexity, the baseline row.
  for (const std::string domain : {"prose", "code"}) {
    double nll = 0, pos = 0;
    for (int w = 0; w < windows; ++w) {
      const json& r = store.get(fmt::format("{}/{}", domain, w));
      nll += r.at("fp16").at("nll").get<double>() * r.at("fp16").at("positions").get<double>();
      pos += r.at("fp16").at("positions").get<double>();
    }
    if (pos > 0)
      rows.insert(rows.begin(), json{{"cache", "fp16"}, {"domain", domain}, {"perplexity", std::exp(nll / pos)},
                                     {"KL/token vs fp16", 0.0}, {"top-1 vs fp16", 1.0},
                                     {"B/token/head (K+V)/2", 2.0 * cfg.head_dim}, {"cells checked", 0}, {"violations", 0}});
  }
  write_table(dir, "quality",
              {"cache", "domain", "perplexity", "KL/token vs fp16", "top-1 vs fp16", "B/token/head (K+V)/2",
               "cells checked", "violations"},
              rows,
              fmt::format("Teacher-forced quality: {} windows of {} tokens per domain, every position scored against "
                          "fp16; ablation rows: dither-int8 keys with dither (per slot) or rounded to nearest, m outlier "
                          "pairs",
                          windows, tokens));
  finish(o, "quality", dir, out, total_bad);
  return total_bad;
}

std::int64_t layer_pollution(const engine::Model& m, const EvalOptions& o, std::ostream& out, std::ostream& err) {
  const std::string dir = experiment_dir(o, "layer-pollution");
  ResultStore store((fs::path(dir) / "results.jsonl").string());
  const model::LlamaConfig& cfg = m.model->config();
  const int count = o.quick ? 1 : 8, n = 20;
  // -1: every layer polluted; −2: none (the fp16 control through the same path).
  std::vector<int> layers = {-2};
  for (int l = 0; l < (o.quick ? 2 : cfg.layers); ++l) layers.push_back(l);
  layers.push_back(-1);
  const std::vector<NeedlePrompt> prompts = needle_prompts(m, count, o.quick ? 64 : 96, o.quick ? 96 : 256, 91);
  ThreadPool pool(o.threads);
  EtaBar bar(err, "layer-pollution", count);
  for (int i = 0; i < count; ++i) {
    const std::string key = fmt::format("p{}", i);
    if (store.has(key)) {
      bar.skip();
      continue;
    }
    const std::vector<std::int32_t> prompt = m.prompt_tokens(prompts[i].text, true);
    const std::vector<std::vector<float>> ref = reference_rows(m, pool, prompt);
    const std::int64_t capacity = static_cast<std::int64_t>(prompt.size()) + n;
    json rec = {{"prompt_tokens", prompt.size()}};
    for (int layer : layers) {
      SoundnessSink sound;
      engine::Cache polluted = engine::make_cache(cfg, capacity, n, checked_cache("kivi-2bit"), {&sound});
      auto exact = std::make_unique<attention::ExactKvCache>(cfg.kv_geometry(capacity));
      std::unique_ptr<kvcache::KvCache> mix;
      if (layer == -2)
        mix = std::move(exact);
      else
        mix = std::make_unique<LayerMix>(std::move(polluted.kv), std::move(exact), layer);
      engine::Session s(*m.model, *mix, pool);
      Agreement ag;
      // The decode steps' cells are checked; the prompt's would cost O(S²) per configuration.
      polluted.certified->set_check_soundness(false);
      s.prefill(prompt, {}, [&](std::int64_t pos, std::span<const float> logits) {
        if (pos + 1 < static_cast<std::int64_t>(prompt.size()))
          ag.add(ref[static_cast<std::size_t>(pos)], logits, prompt[static_cast<std::size_t>(pos) + 1]);
      });
      polluted.certified->set_check_soundness(true);
      engine::GenerateOptions go;
      go.max_new_tokens = n;
      go.stop_tokens = m.stop_tokens();
      const engine::GenerateResult g = engine::decode(s, go);
      json r = ag.to_json();
      r["correct"] = answered(m.tokenizer->decode(g.tokens), prompts[i].answer);
      r["cells_checked"] = sound.checked;
      r["violations"] = sound.violations;
      rec[std::to_string(layer)] = r;
    }
    store.put(key, rec);
    bar.advance();
  }
  bar.finish();
  std::vector<json> rows;
  std::int64_t total_bad = 0;
  int fp16_correct = 0;
  for (int i = 0; i < count; ++i) fp16_correct += store.get(fmt::format("p{}", i)).at("-2").at("correct").get<bool>();
  for (int layer : layers) {
    double kl = 0, pos = 0;
    int correct = 0, lost = 0;
    std::int64_t checked = 0, bad = 0;
    for (int i = 0; i < count; ++i) {
      const json& rec = store.get(fmt::format("p{}", i));
      const json& r = rec.at(std::to_string(layer));
      const double p = r.at("positions").get<double>();
      kl += r.at("kl").get<double>() * p, pos += p;
      correct += r.at("correct").get<bool>();
      lost += rec.at("-2").at("correct").get<bool>() && !r.at("correct").get<bool>();
      checked += r.at("cells_checked").get<std::int64_t>(), bad += r.at("violations").get<std::int64_t>();
    }
    total_bad += bad;
    rows.push_back({{"kivi-2bit in", layer == -2 ? "none (fp16)" : layer == -1 ? "every layer" : fmt::format("layer {}", layer)},
                    {"layer", layer}, {"needle accuracy", double(correct) / count}, {"answers lost vs fp16", lost},
                    {"KL/token vs fp16", kl / pos}, {"cells checked", checked}, {"violations", bad}});
  }
  write_table(dir, "layer-pollution",
              {"kivi-2bit in", "layer", "needle accuracy", "answers lost vs fp16", "KL/token vs fp16", "cells checked",
               "violations"},
              rows,
              fmt::format("Layer pollution: kivi-2bit keys and values in one layer, the others exact; {} needle prompts "
                          "(fp16 answers {} of them); KL teacher-forced over the prompt",
                          count, fp16_correct));
  finish(o, "layer-pollution", dir, out, total_bad);
  return total_bad;
}

std::vector<json> outlier_control(const EvalOptions& o, std::int64_t& violations) {
  // Keys of d channels with a spread of channel gains and 4 massive RoPE pairs (interleaved
  // layout: channels 2j, 2j+1), queries with small components on the massive pairs; the meter of
  // dither-int8 (Tier B, δ_req = 1e-2 over SmolLM2's 30 layers × 9 heads × 256 steps) under three
  // treatments of those pairs.
  const int d = 64, S = o.quick ? 128 : 512, queries = o.quick ? 16 : 128, group = formats::kDefaultGroup;
  const std::vector<int> massive = {3, 11, 19, 27};
  std::mt19937_64 rng(5);
  std::normal_distribution<double> g(0.0, 1.0);
  std::vector<double> gain(d);
  for (double& x : gain) x = std::exp(0.5 * g(rng));
  std::vector<std::uint8_t> mask(d, 0), none(d, 0);
  for (int j : massive) gain[2 * j] = gain[2 * j + 1] = 40.0, mask[2 * j] = mask[2 * j + 1] = 1;
  std::vector<std::vector<float>> k(S, std::vector<float>(d));
  for (auto& row : k)
    for (int c = 0; c < d; ++c) row[c] = static_cast<float>(gain[c] * g(rng));
  // The same queries for every treatment.
  std::vector<std::vector<float>> qs(queries, std::vector<float>(d));
  for (auto& q : qs)
    for (int c = 0; c < d; ++c) q[c] = static_cast<float>(g(rng) * (mask[c] ? 0.02 : 1.0));
  const double sm = 1.0 / std::sqrt(double(d)), dloc = cert::delta_loc(1e-2, 30, 9, 256);
  struct Treatment {
    std::string label;
    bool bypass, exclude;
    double paper_median, paper_max;
  };
  const std::vector<Treatment> treatments = {{"no bypass", false, false, 1.0311, 2.378},
                                             {"bypass, amax unchanged", true, false, 0.9608, 2.177},
                                             {"bypass + excluded from amax", true, true, 0.0620, 0.0731}};
  std::vector<json> rows;
  for (const Treatment& t : treatments) {
    // Each token's reconstruction and scales under the treatment, with one dither per (token, channel).
    std::vector<std::vector<float>> k_hat(S, std::vector<float>(d));
    std::vector<std::vector<f16>> scales(S, std::vector<f16>(d / group));
    std::mt19937_64 xi_rng(9);
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    for (int s = 0; s < S; ++s) {
      std::vector<float> xi(d);
      for (float& x : xi) x = u(xi_rng);
      std::vector<std::int8_t> codes(d);
      std::vector<f16> outl(t.exclude ? 2 * massive.size() : 0);
      const std::vector<std::uint8_t>& enc_mask = t.exclude ? mask : none;
      formats::encode_dither(8, k[s], xi, enc_mask, group, codes, scales[s], outl);
      formats::decode_dither(codes, scales[s], xi, enc_mask, outl, group, k_hat[s]);
      // Bypassed without leaving the amax: the pairs are stored exactly, on the unchanged scales.
      if (t.bypass && !t.exclude)
        for (int c = 0; c < d; ++c)
          if (mask[c]) k_hat[s][c] = fp16_to_float(fp16_from_double(k[s][c]));
    }
    const std::vector<std::uint8_t>& bound_mask = t.bypass ? mask : none;
    const int non_outlier = t.bypass ? d - 2 * static_cast<int>(massive.size()) : d;
    std::vector<double> meters;
    std::int64_t covered = 0;
    for (const std::vector<float>& q : qs) {
      std::vector<double> z(S), z_hat(S), c_t(S), p(S), eps(S);
      for (int s = 0; s < S; ++s) {
        double a = 0, b = 0;
        for (int c = 0; c < d; ++c) {
          a += double(q[c]) * fp16_to_double(fp16_from_double(k[s][c]));
          b += double(q[c]) * k_hat[s][c];
        }
        z[s] = sm * a, z_hat[s] = sm * b, eps[s] = z_hat[s] - z[s];
        c_t[s] = cert::subgaussian_radius(cert::dither_variance_proxy(q, scales[s], bound_mask, group, sm), S, dloc, non_outlier);
      }
      const double mx = *std::max_element(z_hat.begin(), z_hat.end());
      double sum = 0;
      for (int s = 0; s < S; ++s) sum += (p[s] = std::exp(z_hat[s] - mx));
      for (double& x : p) x /= sum;
      const cert::Bounds b = cert::evaluate_logits(z_hat, c_t);
      meters.push_back(b.eform);
      covered += cert::clamp_meter(b.eform) <= 0.2;
      violations += !(cert::true_tv(p, eps) <= cert::clamp_meter(b.eform) * (1 + 1e-9) + 1e-12);
    }
    rows.push_back({{"treatment", t.label}, {"median meter (e-form, raw)", percentile(meters, 0.5)},
                    {"max meter", percentile(meters, 1.0)}, {"coverage at 0.2", double(covered) / queries},
                    {"paper median", t.paper_median}, {"paper max", t.paper_max}, {"queries", queries}});
  }
  return rows;
}

}  // namespace witcert::apps::eval
