// Table 1: the risk–coverage curve. Joint K∧V coverage of the decode steps at τ_K = 0.2,
// τ_V = 0.05 against the request budget δ of dither-int8 keys, beside the deterministic tanh bound
// on keys rounded without dither (δ = 0), for prose, code and needle prompts and outlier budgets
// m = 0 and 4; the default shape (min of sound forms) and the paper's e-form from the same run;
// and the page-in bytes of a gate at the same thresholds.
#include <fmt/format.h>

#include <filesystem>
#include <map>

#include "apps/eval/internal.h"

namespace witcert::apps::eval {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Domain {
  std::string name;
  std::vector<std::vector<std::int32_t>> prompts;
};

}  // namespace

std::int64_t risk_coverage(const engine::Model& m, const EvalOptions& o, std::ostream& out, std::ostream& err) {
  const std::string dir = experiment_dir(o, "risk-coverage");
  ResultStore store((fs::path(dir) / "results.jsonl").string());
  const int prompts = o.quick ? 1 : 3, tokens = o.quick ? 48 : 256, n = o.quick ? 6 : 32;
  std::vector<Domain> domains = {{"prose", {}}, {"code", {}}, {"needle", {}}};
  for (const std::string& t : domain_prompts(m, o, "prose", prompts, tokens, 51)) domains[0].prompts.push_back(m.prompt_tokens(t, false));
  for (const std::string& t : domain_prompts(m, o, "code", prompts, tokens, 52)) domains[1].prompts.push_back(m.prompt_tokens(t, false));
  for (const NeedlePrompt& p : needle_prompts(m, prompts, tokens * 3 / 4, tokens, 53))
    domains[2].prompts.push_back(m.prompt_tokens(p.text, true));
  const std::vector<int> budgets = o.quick ? std::vector<int>{4} : std::vector<int>{0, 4};
  // δ = 0: the deterministic tanh bound on keys rounded without dither.
  const std::vector<double> deltas = o.quick ? std::vector<double>{1e-2, 0.0} : std::vector<double>{1e-4, 1e-2, 5e-2, 0.0};
  ThreadPool pool(o.threads);
  EtaBar bar(err, "risk-coverage", static_cast<std::int64_t>(domains.size() * budgets.size() * deltas.size()));
  for (const Domain& dom : domains)
    for (int budget : budgets)
      for (double delta : deltas) {
        const std::string key = fmt::format("{}/m{}/delta{:g}", dom.name, budget, delta);
        if (store.has(key)) {
          bar.skip();
          continue;
        }
        double served = 0, eform = 0, cells = 0, page_in = 0;
        std::int64_t checked = 0, violations = 0;
        for (const std::vector<std::int32_t>& prompt : dom.prompts) {
          const std::int64_t first = static_cast<std::int64_t>(prompt.size());
          for (bool gated : {false, true}) {
            engine::CacheOptions c = checked_cache("dither-int8");
            c.outliers = budget;
            if (delta > 0) {
              c.delta = delta;
            } else {
              c.dither = kvcache::DitherMode::none;
              c.bound = cert::BoundShape::tanh;
            }
            if (gated) c.gate = gate::Policy::from_tau_k(kTauK, gate::Granularity::block, kTauV);
            CoverageSink cov(first, kTauK, kTauV);
            SoundnessSink sound;
            const CheckedRun r = run_checked(m, pool, prompt, n, c, {&cov, &sound});
            checked += sound.checked, violations += sound.violations;
            if (gated) {
              page_in += static_cast<double>(r.page_in.page_in_bytes);
            } else {
              const double k = static_cast<double>(cov.cells());
              served += cov.before() * k, eform += cov.eform_before() * k, cells += k;
            }
          }
        }
        store.put(key, {{"domain", dom.name}, {"m", budget}, {"delta", delta},
                        {"coverage", cells > 0 ? served / cells : 0.0}, {"coverage_eform", cells > 0 ? eform / cells : 0.0},
                        {"page_in_bytes", page_in / static_cast<double>(dom.prompts.size())},
                        {"cells_checked", checked}, {"violations", violations}});
        bar.advance();
      }
  bar.finish();
  // The paper's Table 1 (Qwen2.5-7B, joint step coverage; δ = 0 is its tanh reference).
  const std::map<std::string, std::map<double, double>> paper = {
      {"prose", {{1e-4, 0.792}, {1e-2, 0.809}, {5e-2, 0.814}, {0.0, 0.167}}},
      {"code", {{1e-4, 0.772}, {1e-2, 0.796}, {5e-2, 0.803}, {0.0, 0.118}}},
      {"needle", {{1e-4, 0.802}, {1e-2, 0.810}, {5e-2, 0.815}, {0.0, 0.485}}}};
  std::vector<json> rows, curve;
  std::int64_t total_bad = 0;
  for (const Domain& dom : domains)
    for (int budget : budgets) {
      json row = {{"domain", dom.name}, {"m", budget}};
      double tanh_page_in = 0;
      for (std::size_t i = 0; i < deltas.size(); ++i) {
        const json& r = store.get(fmt::format("{}/m{}/delta{:g}", dom.name, budget, deltas[i]));
        total_bad += r.at("violations").get<std::int64_t>();
        const std::string col = deltas[i] > 0 ? fmt::format("δ={:g}", deltas[i]) : "tanh (δ=0)";
        row[col] = r.at("coverage");
        if (deltas[i] > 0) row[col + " e-form"] = r.at("coverage_eform");
        if (budget == 4) row["paper " + col] = paper.at(dom.name).at(deltas[i]);
        if (deltas[i] == 0) tanh_page_in = r.at("page_in_bytes").get<double>();
        curve.push_back({{"domain", dom.name}, {"m", budget}, {"delta", deltas[i]}, {"coverage", r.at("coverage")},
                         {"coverage_eform", deltas[i] > 0 ? r.at("coverage_eform") : json(nullptr)},
                         {"page_in_kib", r.at("page_in_bytes").get<double>() / 1024}});
      }
      const double ours = store.get(fmt::format("{}/m{}/delta0.01", dom.name, budget)).at("page_in_bytes").get<double>();
      row["page-in KiB δ=0.01"] = ours / 1024;
      row["page-in KiB tanh"] = tanh_page_in / 1024;
      rows.push_back(row);
    }
  std::vector<std::string> cols = {"domain", "m"};
  for (double d : deltas) {
    const std::string col = d > 0 ? fmt::format("δ={:g}", d) : "tanh (δ=0)";
    cols.push_back(col);
    if (d > 0) cols.push_back(col + " e-form");
    cols.push_back("paper " + col);
  }
  cols.push_back("page-in KiB δ=0.01");
  cols.push_back("page-in KiB tanh");
  write_table(dir, "risk-coverage", cols, rows,
              fmt::format("Risk-coverage: joint K and V coverage of the decode steps at tau_K = 0.2, tau_V = 0.05 "
                          "(default shape; e-form beside it), dither-int8, {} prompts of {} tokens per domain, {} "
                          "decode steps; page-in with a block gate at the same thresholds; paper: Qwen2.5-7B, m = 4",
                          prompts, tokens, n));
  write_table(dir, "curve", {"domain", "m", "delta", "coverage", "coverage_eform", "page_in_kib"}, curve,
              "Risk-coverage points");
  finish(o, "risk-coverage", dir, out, total_bad);
  return total_bad;
}

}  // namespace witcert::apps::eval
