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

  CLI11_PARSE(app, argc, argv);
  try {
    if (*bound) return witcert::apps::run_bound(std::cin, std::cout);
    if (*philox) return witcert::apps::run_philox(counter, key, std::cout);
    if (*schemes) return witcert::apps::run_schemes(std::cout);
    if (*selfcheck) return witcert::apps::run_selfcheck(std::cout);
  } catch (const std::exception& e) {
    std::cerr << "witcert: error: " << e.what() << "\n";
    return 2;
  }
  return 1;
}
