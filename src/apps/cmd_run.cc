#include <fmt/format.h>

#include <cmath>
#include <iostream>
#include <sstream>

#include "apps/commands.h"
#include "apps/run.h"

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
  if (!(a.gate >= 0.0) || !std::isfinite(a.gate)) throw std::invalid_argument("--gate tau must be finite and positive");
  if (!(a.delta > 0.0 && a.delta < 1.0)) throw std::invalid_argument("--delta must lie in (0, 1)");
  const std::string model = a.model.empty() ? default_model_path() : a.model;
  const cert::BoundShape bound = cert::parse_bound_shape(a.bound);
  const cache::DitherMode dither = cache::parse_dither_mode(a.dither);
  const gate::Policy gate{a.gate, gate::parse_granularity(a.granularity), a.tau_v};
  const cache::BackingPlace backing = backing_place(a.backing_file, a.backing_file_overwrite, a.keep_backing_file,
                                                    a.exact_tier, model, gate.on() || a.check_soundness);
  Engine engine = Engine::load(model);
  const std::vector<std::int32_t> prompt = engine.prompt_tokens(a.prompt, a.chat);
  std::vector<std::string> schemes = a.scheme_sweep.empty() ? std::vector<std::string>{a.kv} : split_list(a.scheme_sweep);
  if (schemes.empty() || schemes[0].empty()) throw std::invalid_argument("give --kv SCHEME or --scheme-sweep A,B,...");
  err << fmt::format("prompt: {} tokens; generating up to {} tokens per run\n", prompt.size(), a.n);
  const Fp16Reference fp16 = run_fp16(engine, prompt, a.n, a.threads, progress_bar(err, "fp16"));
  std::vector<RunOutcome> runs;
  for (const std::string& s : schemes) {
    RunConfig rc;
    rc.kv_k = quant::KvFormat::parse(s);
    rc.kv_v = quant::KvFormat::parse(a.kv_v.empty() ? s : a.kv_v);
    rc.gate = gate;
    rc.bound = bound;
    rc.coverage_tau = a.coverage_tau;
    rc.delta = a.delta;
    rc.check_soundness = a.check_soundness;
    rc.stride = a.stride;
    rc.backing = backing;
    rc.dither = dither;
    rc.label = s + (a.kv_v.empty() ? "" : "/" + a.kv_v);
    runs.push_back(run_request(engine, prompt, a.n, rc, a.threads, fp16, progress_bar(err, rc.label)));
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
