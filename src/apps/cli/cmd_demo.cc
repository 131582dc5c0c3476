#include <fmt/format.h>

#include <chrono>
#include <iostream>

#include "apps/cli/commands.h"
#include "apps/eval/eval.h"
#include "apps/report/run.h"

namespace witcert::apps {
namespace {

constexpr const char* kNeedle = "The secret passphrase for the archive is orange-falcon-17.";
constexpr const char* kAnswer = "orange-falcon-17";

// A haystack of ordinary sentences with the needle about 40 % of the way in, and the question.
std::string needle_prompt(const engine::Model& e, int target_tokens) {
  return eval::needle_text(e, target_tokens * 2 / 5, target_tokens, kNeedle,
                           "What is the secret passphrase for the archive? Answer with the passphrase only.",
                           {0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
}

}  // namespace

int run_demo(const std::string& model, int threads, int tokens, const std::string& report, std::ostream& out,
             std::ostream& err) {
  if (tokens < 64 || tokens > 7000) throw std::invalid_argument("--tokens must lie in [64, 7000]");
  const auto t0 = std::chrono::steady_clock::now();
  engine::Model engine = engine::Model::load(model.empty() ? engine::default_model_path() : model);
  const std::string text = needle_prompt(engine, tokens);
  const std::vector<std::int32_t> prompt = engine.prompt_tokens(text, /*chat=*/true);
  const int n = 24;
  err << fmt::format("WitCert demo: needle retrieval, {} prompt tokens, SmolLM2-135M on {} threads\n", prompt.size(),
                     threads);
  const Fp16Reference fp16 = run_fp16(engine, prompt, n, threads, progress_bar(err, "[0/6] fp16 reference"));
  err << "  fp16 reference answered: " << fp16.run.text << "\n";

  auto config = [](std::string label, std::string kv, double tau) {
    RunConfig c;
    c.label = std::move(label);
    c.cache.certified = true;
    c.cache.k_format = c.cache.v_format = formats::KvFormat::parse(kv);
    c.cache.gate = gate::Policy::from_tau_k(tau, gate::Granularity::block);
    return c;
  };
  const std::vector<RunConfig> configs = {
      config("q4_0 raw", "q4_0", 0.0),
      config("q4_0 gated", "q4_0", 0.5),
      config("fp8-e4m3 raw", "fp8-e4m3", 0.0),
      config("fp8-e4m3 gated", "fp8-e4m3", 0.2),
      config("rtn-int8 raw", "rtn-int8", 0.0),
      config("dither-int8 gated", "dither-int8", 0.2),
  };
  std::vector<RunOutcome> runs;
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const std::string label = fmt::format("[{}/{}] {}", i + 1, configs.size(), configs[i].label);
    runs.push_back(run_request(engine, prompt, n, configs[i], threads, fp16, progress_bar(err, label)));
  }
  out << fmt::format("\nNeedle retrieval ({} prompt tokens; the needle: \"{}\")\n", prompt.size(), kNeedle);
  out << "fp16 answer: " << fp16.run.text << "\n\n";
  print_table(out, runs, kAnswer);
  out << "\n" << coverage_legend(runs);
  write_report(report, text, fp16.run, runs, kAnswer);
  out << fmt::format("report: {}/report.md   (total {:.0f} s)\n", report,
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

}  // namespace witcert::apps
