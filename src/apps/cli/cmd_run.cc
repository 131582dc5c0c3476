#include <fmt/format.h>

#include <cmath>
#include <iostream>
#include <sstream>

#include "apps/cli/commands.h"
#include "apps/report/run.h"

namespace witcert::apps {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

int run_run(const RunArgs& a, std::ostream& out, std::ostream& err) {
  const std::string model = a.model.empty() ? engine::default_model_path() : a.model;
  std::vector<std::string> schemes = a.scheme_sweep.empty() ? std::vector<std::string>{a.cache.kv} : split_list(a.scheme_sweep);
  if (schemes.empty() || schemes[0].empty()) throw std::invalid_argument("give --kv SCHEME or --scheme-sweep A,B,...");
  std::vector<RunConfig> configs;
  for (const std::string& s : schemes) {
    RunConfig rc;
    rc.cache = cache_options(a.cache, s, model);
    rc.coverage_tau = a.cache.coverage_tau;
    rc.stride = a.stride;
    rc.label = s + (a.cache.kv_v.empty() ? "" : "/" + a.cache.kv_v);
    configs.push_back(rc);
  }
  engine::Model engine = engine::Model::load(model);
  const std::vector<std::int32_t> prompt = engine.prompt_tokens(a.prompt, a.chat);
  err << fmt::format("prompt: {} tokens; generating up to {} tokens per run\n", prompt.size(), a.n);
  const Fp16Reference fp16 = run_fp16(engine, prompt, a.n, a.threads, progress_bar(err, "fp16"));
  std::vector<RunOutcome> runs;
  for (const RunConfig& rc : configs)
    runs.push_back(run_request(engine, prompt, a.n, rc, a.threads, fp16, progress_bar(err, rc.label)));
  if (a.json) {
    out << report_json(a.prompt, fp16.run, runs).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!a.report.empty()) write_report(a.report, a.prompt, fp16.run, runs);
    return 0;
  }
  out << "fp16:        " << fp16.run.text << "\n";
  for (const RunOutcome& r : runs) out << fmt::format("{:<12} {}\n", r.config.label + ":", r.text);
  out << "\n";
  print_table(out, runs);
  out << "\n" << coverage_legend(runs);
  for (const RunOutcome& r : runs)
    if (r.meter.checked > 0)
      out << fmt::format("soundness {}: {} cells checked, {} violations\n", r.config.label, r.meter.checked,
                         r.meter.violations);
  if (!a.report.empty()) {
    write_report(a.report, a.prompt, fp16.run, runs);
    out << "report: " << a.report << "/report.md\n";
  }
  return 0;
}

}  // namespace witcert::apps
