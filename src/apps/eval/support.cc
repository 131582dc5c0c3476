// The helpers the experiments share (internal.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>

#include "apps/eval/internal.h"
#include "engine/cache_factory.h"
#include "engine/session.h"
#include "formats/kv_format.h"
#include "gate/certified_cache.h"

namespace witcert::apps::eval {

namespace fs = std::filesystem;

void SoundnessSink::record(std::span<const gate::MeterCell> cells) {
  std::int64_t n = 0, bad = 0, decode = 0, danger = 0;
  double worst = 0.0, tv_max = 0.0, worst_v = 0.0;
  const auto ratio = [](double truth, double bound) { return bound > 0 ? truth / bound : (truth > 0 ? HUGE_VAL : 0.0); };
  for (const gate::MeterCell& c : cells) {
    if (std::isnan(c.tv)) continue;
    ++n;
    bad += gate::violates(c);
    worst = std::max(worst, ratio(c.tv, c.meter));
    if (!std::isnan(c.v_true)) worst_v = std::max(worst_v, ratio(c.v_true, c.v_meter));
    tv_max = std::max(tv_max, c.tv);
    if (c.pos >= first_) ++decode, danger += c.tv > 0.2;
  }
  std::lock_guard lock(mu_);
  checked += n;
  violations += bad;
  decode_checked += decode;
  dangerous += danger;
  worst_ratio = std::max(worst_ratio, worst);
  worst_v_ratio = std::max(worst_v_ratio, worst_v);
  max_tv = std::max(max_tv, tv_max);
}

void CellSample::record(std::span<const gate::MeterCell> cells) {
  std::lock_guard lock(mu_);
  for (const gate::MeterCell& c : cells)
    if (c.pos >= first_ && !std::isnan(c.tv) && seen_++ % every_ == 0) kept.push_back({c.eform_raw, c.meter, c.tv});
}

void CoverageSink::record(std::span<const gate::MeterCell> cells) {
  std::int64_t n = 0, served = 0, before = 0, eform = 0;
  for (const gate::MeterCell& c : cells) {
    if (c.pos < first_) continue;
    ++n;
    served += c.meter <= tau_k_ && c.v_meter <= tau_v_;
    const bool v = c.v_meter_before <= tau_v_;
    before += v && c.meter_before <= tau_k_;
    eform += v && std::min(c.raw_before, 1.0) <= tau_k_;
  }
  std::lock_guard lock(mu_);
  cells_ += n, served_ += served, before_ += before, eform_ += eform;
}

engine::CacheOptions checked_cache(const std::string& kv) {
  engine::CacheOptions o = engine::CacheOptions::from_json({{"kv", kv}});
  o.check_soundness = true;
  return o;
}

std::string bound_caption(cert::BoundShape shape) {
  return fmt::format("bound shape of the meter and coverage: {}", cert::bound_shape_label(shape));
}

CheckedRun run_checked(const engine::Model& m, ThreadPool& pool, const std::vector<std::int32_t>& prompt, int n,
                       const engine::CacheOptions& opts, std::vector<gate::MeterSink*> sinks, bool stop,
                       bool check_prompt) {
  const model::LlamaConfig& cfg = m.model->config();
  const engine::Cache c = engine::make_cache(cfg, static_cast<std::int64_t>(prompt.size()) + n, n, opts, std::move(sinks));
  engine::Session session(*m.model, *c.kv, pool);
  engine::GenerateOptions go;
  go.max_new_tokens = n;
  if (stop) go.stop_tokens = m.stop_tokens();
  CheckedRun r;
  const bool checked = c.certified != nullptr && opts.check_soundness;
  if (checked && !check_prompt) c.certified->set_check_soundness(false);
  session.prefill(prompt);
  if (checked) c.certified->set_check_soundness(true);
  r.tokens = engine::decode(session, go).tokens;
  if (c.certified != nullptr) r.page_in = c.certified->store().page_in_stats();
  return r;
}

std::string experiment_dir(const EvalOptions& o, const std::string& name) { return (fs::path(o.out) / name).string(); }

void finish(const EvalOptions& o, const std::string& name, const std::string& dir, std::ostream& out,
            std::int64_t violations) {
  std::ifstream md(fs::path(dir) / (name + ".md"));
  out << md.rdbuf() << "\n";
  for (const std::string& f : draw_plots(o, name, dir)) out << "plot: " << f << "\n";
  out << fmt::format("{}: {} soundness violations\n\n", name, violations);
}

std::vector<std::string> metered_schemes() {
  std::vector<std::string> s;
  for (const std::string& n : formats::kv_format_names())
    if (n != "fp16") s.push_back(n);
  return s;
}

std::string needle_text(const engine::Model& m, int before_tokens, int target_tokens, const std::string& needle,
                        const std::string& question, const std::vector<int>& order) {
  static const char* const kFiller[] = {
      "The river flows slowly through the valley, past farms and old stone bridges.",
      "In the spring the orchards bloom, and the air smells of apples and cut grass.",
      "Merchants once carried salt and wool along this road to the coastal towns.",
      "The library keeps maps of the region drawn by surveyors two centuries ago.",
      "Every autumn the village holds a market where bakers sell bread and honey cakes.",
      "A lighthouse stands on the cliff, and its keeper writes the weather in a ledger.",
      "The school teaches mathematics, music and the history of the northern provinces.",
      "Fishermen mend their nets on the pier while gulls circle above the harbour.",
      "The mountain pass closes in winter, when snow covers the path for months.",
      "Scholars debate whether the old tower was built as a fortress or a granary.",
      "The mill by the stream grinds wheat from the farms on the eastern hills.",
      "Travellers rest at the inn, where the fire burns late into the evening.",
      "The bell of the town hall rings at noon and again at six in the evening.",
      "Shepherds lead their flocks to the high meadows when the snow has melted.",
      "The canal was dug by hand, and barges still carry coal along its banks.",
      "A choir sings in the cathedral every Sunday, and visitors fill the benches.",
  };
  if (order.empty()) throw std::invalid_argument("needle_text: no haystack sentences");
  for (int i : order)
    if (i < 0 || i >= static_cast<int>(std::size(kFiller))) throw std::invalid_argument("needle_text: no such sentence");
  const auto tokens = [&](const std::string& s) { return static_cast<int>(m.tokenizer->encode(s, false).size()); };
  std::string before, after;
  std::size_t k = 0;
  while (tokens(before) < before_tokens) before += std::string(kFiller[order[k++ % order.size()]]) + " ";
  while (tokens(before + after) < target_tokens) after += std::string(kFiller[order[k++ % order.size()]]) + " ";
  return "Read the following text carefully.\n\n" + before + needle + " " + after + "\n\nQuestion: " + question;
}

std::vector<NeedlePrompt> needle_prompts(const engine::Model& m, int count, int min_tokens, int max_tokens,
                                         std::uint64_t seed) {
  static const char* const kAdjectives[] = {"orange", "silver", "quiet", "golden", "rapid", "hidden", "crimson", "lucky",
                                            "frozen", "bright", "gentle", "northern", "purple", "brave", "ancient", "velvet"};
  static const char* const kAnimals[] = {"falcon", "otter", "badger", "heron", "lynx", "marten", "raven", "salmon",
                                         "beaver", "osprey", "walrus", "gecko", "bison", "ferret", "pelican", "tiger"};
  static const char* const kPlaces[] = {"archive", "vault", "observatory", "warehouse", "laboratory", "museum"};
  if (min_tokens < 16 || max_tokens < min_tokens) throw std::invalid_argument("needle prompts: bad length range");
  std::mt19937_64 rng(seed);
  std::vector<NeedlePrompt> out;
  for (int i = 0; i < count; ++i) {
    NeedlePrompt p;
    const std::string place = kPlaces[rng() % 6];
    p.answer = fmt::format("{}-{}-{}", kAdjectives[rng() % 16], kAnimals[rng() % 16], 10 + rng() % 90);
    p.target_tokens = min_tokens + static_cast<int>(rng() % static_cast<std::uint64_t>(max_tokens - min_tokens + 1));
    p.depth = 0.1 + 0.8 * std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    std::vector<int> order(16);
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int>(k);
    std::shuffle(order.begin(), order.end(), rng);
    p.text = needle_text(m, static_cast<int>(p.target_tokens * p.depth), p.target_tokens,
                         fmt::format("The secret passphrase for the {} is {}.", place, p.answer),
                         fmt::format("What is the secret passphrase for the {}? Answer with the passphrase only.", place),
                         order);
    out.push_back(std::move(p));
  }
  return out;
}

bool answered(const std::string& text, const std::string& answer) { return text.find(answer) != std::string::npos; }

}  // namespace witcert::apps::eval
