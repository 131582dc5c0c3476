#include <iostream>
#include <stdexcept>
#include <string>

#include <CLI/CLI.hpp>

#include "apps/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"WitCert: sound, per-request meters for quantized KV caches"};
  app.require_subcommand(1);

  auto* bound = app.add_subcommand(
      "bound", "Bounds on attention TV for JSON lines {\"p_tilde\":[...],\"c\":[...],\"eps\":[...]} on stdin");

  std::string counter, key;
  auto* philox = app.add_subcommand("philox", "Philox4x32-10 of one counter under one key");
  philox->add_option("--counter", counter, "four 32-bit words A,B,C,D (decimal or 0x-hex)")->required();
  philox->add_option("--key", key, "two 32-bit words K0,K1 (decimal or 0x-hex)")->required();

  auto* schemes = app.add_subcommand("schemes", "The KV-cache scheme registry and each scheme's bytes per token");

  auto* selfcheck = app.add_subcommand("selfcheck", "The paper's counterexample table and known-answer checks");

  witcert::apps::GenerateArgs gen;
  auto* generate = app.add_subcommand("generate", "Generate text with the model");
  generate->add_option("--model", gen.model, "GGUF model file (default: the fetched SmolLM2-135M)");
  generate->add_option("--prompt", gen.prompt, "prompt text")->required();
  generate->add_flag("--chat", gen.chat, "wrap the prompt as a user turn of the model's chat template");
  generate->add_option("--n", gen.n, "maximum new tokens")->check(CLI::NonNegativeNumber);
  generate->add_option("--temp", gen.temperature, "temperature (0: greedy)");
  generate->add_option("--top-p", gen.top_p, "nucleus sampling mass in (0, 1]");
  generate->add_option("--seed", gen.seed, "sampling seed");
  generate->add_option("--threads", gen.threads, "worker threads")->check(CLI::PositiveNumber);
  generate->add_option("--kv", gen.kv_k, "KV-cache format of the keys (and values): fp16, dither-int8 or a scheme of `witcert schemes`");
  generate->add_option("--kv-v", gen.kv_v, "KV-cache format of the values (default: --kv)");
  generate->add_option("--outliers", gen.outliers, "dither-int8: outlier RoPE pairs kept in fp16")->check(CLI::NonNegativeNumber);
  generate->add_option("--page-size", gen.page_size, "tokens per cache page")->check(CLI::PositiveNumber);
  generate->add_option("--delta", gen.delta, "request-level failure budget of the Tier-B certificate, in (0, 1)");
  generate->add_option("--tau", gen.tau, "meter threshold for the coverage figure, > 0");
  generate->add_option("--dither", gen.dither,
                       "dither-int8 keys: per-slot, shared-page or shared-prompt (default; docs/dither-cost.md)");
  generate->add_flag("--shared-page-dither", gen.shared_page_dither, "the same as --dither shared-page");
  generate->add_option("--dither-seed", gen.dither_seed, "dither-int8: seed of the key dither's Philox stream");
  generate->add_flag("--check-soundness", gen.check_soundness, "compare every meter with the true TV from the exact tier");
  generate->add_option("--meter-json", gen.meter_json, "write every (layer, head, position) meter as JSON lines");
  generate->add_option("--backing-file", gen.backing_file, "keep the exact tier in this memory-mapped file instead of RAM");

  witcert::apps::LogitsArgs lg;
  auto* logits = app.add_subcommand("logits", "Top-K next-token logits after a prompt, as JSON");
  logits->add_option("--model", lg.model, "GGUF model file (default: the fetched SmolLM2-135M)");
  logits->add_option("--prompt", lg.prompt, "prompt text")->required();
  logits->add_flag("--chat", lg.chat, "wrap the prompt as a user turn of the model's chat template");
  logits->add_option("--top", lg.top, "how many candidates")->check(CLI::PositiveNumber);
  logits->add_option("--threads", lg.threads, "worker threads")->check(CLI::PositiveNumber);

  witcert::apps::RunArgs ra;
  auto* runc = app.add_subcommand("run", "One request under a KV format, gated or not, against fp16: quality, meter, page-ins");
  runc->add_option("prompt", ra.prompt, "prompt text")->required();
  runc->add_option("--model", ra.model, "GGUF model file (default: the fetched SmolLM2-135M)");
  runc->add_option("--kv", ra.kv, "KV-cache format: fp16, dither-int8 or a scheme of `witcert schemes`");
  runc->add_option("--kv-v", ra.kv_v, "format of the values (default: --kv)");
  runc->add_option("--scheme-sweep", ra.scheme_sweep, "comma-separated formats, one run each, one table");
  auto* gate_opt = runc->add_option("--gate", ra.gate, "gate threshold tau > 0: < 1 certified (meter), >= 1 risk-ranked (raw score)");
  runc->add_option("--granularity", ra.granularity, "repair granularity: head, block or request");
  runc->add_option("--delta", ra.delta, "Tier-B request-level failure budget in (0, 1)");
  runc->add_option("--n", ra.n, "tokens to generate")->check(CLI::PositiveNumber);
  runc->add_flag("--chat", ra.chat, "wrap the prompt as a user turn of the chat template");
  runc->add_flag("--check-soundness", ra.check_soundness, "compare every meter with the true TV from the exact tier");
  runc->add_option("--report", ra.report, "directory for report.json, report.md, heatmaps and meter JSON lines");
  runc->add_option("--telemetry-stride", ra.stride, "keep every N-th decode step's cells for the quantiles and JSON lines")
      ->check(CLI::PositiveNumber);
  runc->add_option("--backing-file", ra.backing_file, "keep the exact tier in this memory-mapped file instead of RAM");
  runc->add_option("--dither", ra.dither,
                   "dither-int8 keys: per-slot, shared-page or shared-prompt (default; docs/dither-cost.md)");
  runc->add_option("--threads", ra.threads, "worker threads")->check(CLI::PositiveNumber);

  std::string demo_model, demo_report = "out/demo";
  int demo_threads = 2, demo_tokens = 1500;
  auto* demo = app.add_subcommand("demo", "Needle retrieval under damaging and safe caches, raw and gated (the main job)");
  demo->add_option("--model", demo_model, "GGUF model file (default: the fetched SmolLM2-135M)");
  demo->add_option("--report", demo_report, "directory for the report");
  demo->add_option("--threads", demo_threads, "worker threads")->check(CLI::PositiveNumber);
  demo->add_option("--tokens", demo_tokens, "length of the haystack in tokens");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*bound) return witcert::apps::run_bound(std::cin, std::cout);
    if (*philox) return witcert::apps::run_philox(counter, key, std::cout);
    if (*schemes) return witcert::apps::run_schemes(std::cout);
    if (*selfcheck) return witcert::apps::run_selfcheck(std::cout);
    if (*generate) return witcert::apps::run_generate(gen, std::cout, std::cerr);
    if (*logits) return witcert::apps::run_logits(lg, std::cout);
    if (*runc) {
      if (*gate_opt && !(ra.gate > 0.0))
        throw std::invalid_argument("--gate tau must be positive (leave it out to run without a gate)");
      return witcert::apps::run_run(ra, std::cout, std::cerr);
    }
    if (*demo) return witcert::apps::run_demo(demo_model, demo_threads, demo_tokens, demo_report, std::cout, std::cerr);
  } catch (const std::exception& e) {
    std::cerr << "witcert: error: " << e.what() << "\n";
    return 2;
  }
  return 1;
}
