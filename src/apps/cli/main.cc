#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

#include "apps/cli/commands.h"
#include "apps/eval/eval.h"
#include "kvcache/kv_store.h"

namespace {

// A command line that cannot run as written; main prints it and exits 2 like CLI11's own errors.
// It is not a CLI::ValidationError so that CLI11 passes our wording through unchanged.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr long long kMaxTokens = 1'000'000;

// The text of a numeric option read as T (float, double or long double), or a usage error.
// A value beyond T's range reads as ±inf, so finiteness is checked in the option's own type.
template <class T>
T read_number(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  T v;
  if constexpr (std::is_same_v<T, float>)
    v = std::strtof(text.c_str(), &end);
  else if constexpr (std::is_same_v<T, double>)
    v = std::strtod(text.c_str(), &end);
  else
    v = std::strtold(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size()) throw UsageError(flag + ": '" + text + "' is not a number");
  return v;
}

// A real option of type T for which `ok` holds, else a usage error saying what `flag` must be.
template <class T>
CLI::Validator real(const std::string& flag, std::function<bool(T)> ok, const std::string& requirement) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        if (!ok(read_number<T>(flag, text))) throw UsageError(flag + " must be " + requirement + ", got '" + text + "'");
        return {};
      },
      requirement);
}

// A whole number in [lo, hi], rewritten in decimal so that CLI11's integer conversion reads what
// was checked (e.g. 1e3): options add it with ->transform, as ->check would hand it a copy.
CLI::Validator whole_in(const std::string& flag, long long lo, long long hi) {
  const std::string requirement = "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        const long double v = read_number<long double>(flag, text);
        if (!(std::isfinite(v) && v == std::floor(v))) throw UsageError(flag + ": '" + text + "' is not a whole number");
        if (!(lo <= v && v <= hi)) throw UsageError(flag + " must be " + requirement + ", got '" + text + "'");
        text = std::to_string(static_cast<long long>(v));
        return {};
      },
      requirement);
}

// A 64-bit seed as engine::parse_u64 reads it (decimal or 0x-hex digits, below 2^64), rewritten in
// decimal so that CLI11's own conversion reads what was checked: its strtoull saturates above
// 2^64 - 1 and reads a leading 0 as octal. Options add it with ->transform, as ->check would
// hand it a copy.
CLI::Validator seed(const std::string& flag) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        try {
          text = std::to_string(witcert::engine::parse_u64(text, flag));
        } catch (const std::invalid_argument& e) {
          throw UsageError(e.what());
        }
        return {};
      },
      "[0, 2^64)");
}

// One of a fixed set of words.
CLI::Validator choice(const std::string& flag, const std::vector<std::string>& words) {
  std::string list;
  for (const std::string& w : words) list += (list.empty() ? "" : ", ") + w;
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        for (const std::string& w : words)
          if (text == w) return {};
        throw UsageError(flag + " must be one of " + list + ", got '" + text + "'");
      },
      "{" + list + "}");
}

// A dither mode, as kvcache::parse_dither_mode reads it.
CLI::Validator dither_mode(const std::string& flag) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        try {
          witcert::kvcache::parse_dither_mode(text);
        } catch (const std::invalid_argument& e) {
          throw UsageError(flag + ": " + e.what());
        }
        return {};
      },
      "{per-slot, shared-page, shared-prompt, none}");
}

CLI::Validator positive_finite(const std::string& flag) {
  return real<double>(flag, [](double v) { return std::isfinite(v) && v > 0; }, "finite and > 0");
}

template <class T>
CLI::Validator half_open_unit(const std::string& flag) {
  return real<T>(flag, [](T v) { return v > 0 && v <= 1; }, "in (0, 1]");
}

// Whether `opt` was given on the command line (not whether its value differs from the default).
bool given(const CLI::Option* opt) { return opt->count() > 0; }

// --model, --prompt and --chat, which generate and logits share.
template <class Args>
void add_prompt_options(CLI::App* cmd, Args& a) {
  cmd->add_option("--model", a.model, "GGUF model file (default: the fetched SmolLM2-135M)");
  cmd->add_option("--prompt", a.prompt, "prompt text")->required();
  cmd->add_flag("--chat", a.chat, "wrap the prompt as a user turn of the model's chat template");
}

// The options the exact backing tier shares between `run` and `generate`.
struct TierOptions {
  CLI::Option* backing_file;
  CLI::Option* overwrite;
  CLI::Option* keep;
  CLI::Option* exact_tier;
};

template <class Args>
TierOptions add_tier_options(CLI::App* cmd, Args& a) {
  TierOptions t;
  t.backing_file = cmd->add_option("--backing-file", a.backing_file,
                                   "keep the exact tier in this memory-mapped file instead of RAM");
  t.overwrite = cmd->add_flag("--backing-file-overwrite", a.backing_file_overwrite,
                              "replace an existing --backing-file instead of refusing to");
  t.keep = cmd->add_flag("--keep-backing-file", a.keep_backing_file, "leave the --backing-file in place at exit");
  t.exact_tier = cmd->add_option("--exact-tier", a.exact_tier,
                                 "where the exact backing tier lives when one is needed: a memory-mapped file in a "
                                 "private temporary directory (default) or RAM")
                     ->check(choice("--exact-tier", {"ram", "file"}));
  return t;
}

// The options of the gate and the meter that `run` and `generate` share; returns --tau-k's option.
template <class Args>
CLI::Option* add_meter_options(CLI::App* cmd, Args& a) {
  CLI::Option* gate = cmd->add_option("--tau-k,--gate,--tau", a.gate,
                                      "K-side gate threshold tau_K > 0 (the tau_k of JSON, the C API and Python): < 1 "
                                      "certified (meter), >= 1 risk-ranked (raw score); leave it out for no gate")
                          ->check(positive_finite("--tau-k/--gate/--tau"));
  cmd->add_option("--tau-v", a.tau_v, "V-side threshold of the joint gate and of the V coverage figure, > 0")
      ->check(positive_finite("--tau-v"));
  cmd->add_option("--coverage-tau", a.coverage_tau,
                  "meter threshold of the coverage figure, in (0, 1] (default: a certified gate's tau_K, else 0.2)")
      ->check(half_open_unit<double>("--coverage-tau"));
  cmd->add_option("--bound", a.bound,
                  "meter's bound shape: eform, two-sided, retention, tanh, tanh-half or min (default min: the minimum "
                  "of the sound forms)")
      ->check(choice("--bound", {"eform", "two-sided", "retention", "tanh", "tanh-half", "min"}));
  return gate;
}

// The tier flags that only make sense together.
void check_tier(const TierOptions& t, const std::string& exact_tier) {
  for (const auto& [opt, name] : {std::pair{t.overwrite, "--backing-file-overwrite"}, {t.keep, "--keep-backing-file"}})
    if (given(opt) && !given(t.backing_file))
      throw UsageError(std::string(name) + " applies to a --backing-file; none was given");
  if (given(t.backing_file) && given(t.exact_tier) && exact_tier == "ram")
    throw UsageError("--exact-tier ram contradicts --backing-file, which puts the exact tier in a file");
}

// The cache options of a command over one shared pool (`batch`, `serve`): formats, page size,
// meter, gate and exact tier.
struct PoolCacheOptions {
  CLI::Option *kv, *kv_v, *gate, *granularity, *delta, *bound, *tau_v, *coverage_tau;
  TierOptions tier;
};

PoolCacheOptions add_pool_cache_options(CLI::App* cmd, witcert::apps::CacheFlags& c) {
  PoolCacheOptions o;
  o.kv = cmd->add_option("--kv", c.kv,
                         "KV-cache format of the keys (and values): fp16, dither-int4/5/6/8 or a scheme of `witcert schemes` "
                         "(default: the plain exact cache, no meter)");
  o.kv_v = cmd->add_option("--kv-v", c.kv_v, "KV-cache format of the values (default: --kv)");
  cmd->add_option("--page-size", c.page_size, "tokens per cache page")->transform(whole_in("--page-size", 1, 4096));
  o.gate = add_meter_options(cmd, c);
  o.granularity = cmd->add_option("--granularity", c.granularity, "repair granularity of the gate: block, head or request")
                      ->check(choice("--granularity", {"block", "head", "request"}));
  o.delta = cmd->add_option("--delta", c.delta, "request-level failure probability of the Tier-B meter, in (0, 1)");
  o.bound = cmd->get_option("--bound");
  o.tau_v = cmd->get_option("--tau-v");
  o.coverage_tau = cmd->get_option("--coverage-tau");
  o.tier = add_tier_options(cmd, c);
  return o;
}

// Without --kv the command keeps the plain exact cache: every meter, gate and tier flag is an error.
void check_pool_cache_options(const PoolCacheOptions& o, const witcert::apps::CacheFlags& c, const std::string& command) {
  if (!given(o.kv))
    for (const CLI::Option* opt : {o.kv_v, o.gate, o.granularity, o.delta, o.bound, o.tau_v, o.coverage_tau,
                                   o.tier.backing_file, o.tier.overwrite, o.tier.keep, o.tier.exact_tier})
      if (given(opt))
        throw UsageError(opt->get_name() + " needs --kv: without it " + command + " keeps a plain exact cache");
  if (given(o.granularity) && !given(o.gate)) throw UsageError("--granularity applies to a gate; give --tau-k");
  check_tier(o.tier, c.exact_tier);
}

// The command's coverage τ, by the rule of every entry point (engine::coverage_tau): --coverage-tau
// when given, else a certified gate's τ_K, else the default.
void resolve_coverage_tau(witcert::apps::CacheFlags& c, const CLI::Option* coverage_tau) {
  c.coverage_tau = witcert::engine::coverage_tau(witcert::gate::Policy::from_tau_k(c.gate),
                                                 given(coverage_tau) ? std::optional(c.coverage_tau) : std::nullopt);
}

// --key-scales: what one scale of dithered keys covers (formats::ScaleGranularity).
CLI::Option* add_key_scales_option(CLI::App* cmd, witcert::apps::CacheFlags& c) {
  return cmd->add_option("--key-scales", c.key_scales,
                         "dithered keys: token (default; one scale per token and 32 channels) or channel (one per "
                         "channel and 256-token block, as in the paper's Tables 1 and 4; scalar path, docs/tier-b.md)")
      ->check(choice("--key-scales", {"token", "channel"}));
}

// --outliers, --dither and --key-scales shape dithered keys only: an error when no K format is
// dither-int4/5/6/8.
void check_dither_flags(const std::vector<const CLI::Option*>& dither_opts, const std::vector<std::string>& k_formats,
                        const std::string& formats_flag) {
  for (const std::string& f : k_formats)
    for (int bits : witcert::formats::kDitherBits)
      if (f == witcert::formats::KvFormat::dither(bits).name()) return;
  for (const CLI::Option* opt : dither_opts)
    if (given(opt))
      throw UsageError(opt->get_name() + " applies to dithered keys (dither-int4/5/6/8) only; " + formats_flag + " gives none");
}

// Edits between a and b: insertions, deletions, substitutions and swaps of neighbours.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// " (did you mean X?)" for the closest of `names` to `word` within a third of its length, else "".
std::string did_you_mean(const std::string& word, const std::vector<std::string>& names) {
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(1, word.size() / 3) + 1;
  for (const std::string& n : names)
    if (const std::size_t d = edit_distance(word, n); d < best_distance) {
      best = n;
      best_distance = d;
    }
  return best.empty() ? "" : " (did you mean " + best + "?)";
}

// The suggestions for the flags of argv that `cmd` does not know.
std::string flag_suggestions(const CLI::App& cmd, int argc, char** argv) {
  std::vector<std::string> names;
  for (const CLI::Option* opt : cmd.get_options())
    for (const std::string& n : opt->get_lnames()) names.push_back("--" + n);
  std::string out;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) continue;
    arg = arg.substr(0, arg.find('='));
    if (std::find(names.begin(), names.end(), arg) != names.end()) continue;
    if (const std::string hint = did_you_mean(arg, names); !hint.empty()) out += "; " + arg + hint;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"WitCert: sound, per-request meters for quantized KV caches"};
  // Every option shows its default in --help (subcommands inherit the option defaults).
  app.option_defaults()->always_capture_default();
  app.require_subcommand(1);

  auto* bound = app.add_subcommand(
      "bound", "Bounds on attention TV for JSON lines {\"z\" (logits) or \"p_tilde\":[...],\"c\":[...],\"eps\":[...]} on stdin");

  std::string counter, key;
  auto* philox = app.add_subcommand("philox", "Philox4x32-10 of one counter under one key");
  philox->add_option("--counter", counter, "four 32-bit words A,B,C,D (decimal or 0x-hex)")->required();
  philox->add_option("--key", key, "two 32-bit words K0,K1 (decimal or 0x-hex)")->required();

  auto* schemes = app.add_subcommand("schemes", "The KV-cache scheme registry and each scheme's bytes per token");

  auto* selfcheck = app.add_subcommand("selfcheck", "The paper's counterexample table and known-answer checks");

  witcert::apps::GenerateArgs gen;
  auto* generate = app.add_subcommand("generate", "Generate text with the model");
  add_prompt_options(generate, gen);
  generate->add_option("--n", gen.n, "maximum new tokens")->transform(whole_in("--n", 0, kMaxTokens));
  generate->add_option("--temp", gen.temperature, "temperature (0: greedy)")
      ->check(real<float>("--temp", [](float v) { return std::isfinite(v) && v >= 0; }, "finite and >= 0"));
  generate->add_option("--top-p", gen.top_p, "nucleus sampling mass in (0, 1]")->check(half_open_unit<float>("--top-p"));
  generate->add_option("--top-k", gen.top_k, "sample among the k most likely tokens (0: every token)")
      ->transform(whole_in("--top-k", 0, std::numeric_limits<int>::max()));
  generate->add_option("--seed", gen.seed, "sampling seed")->transform(seed("--seed"));
  generate->add_option("--threads", gen.threads, "worker threads")->transform(whole_in("--threads", 1, 256));
  auto* gen_kv = generate->add_option(
      "--kv", gen.cache.kv, "KV-cache format of the keys (and values): fp16, dither-int4/5/6/8 or a scheme of `witcert schemes`");
  auto* gen_kv_v = generate->add_option("--kv-v", gen.cache.kv_v, "KV-cache format of the values (default: --kv)");
  auto* gen_outliers = generate->add_option("--outliers", gen.cache.outliers, "dithered keys (dither-int4/5/6/8): outlier RoPE pairs kept in fp16")
                           ->transform(whole_in("--outliers", 0, 31));
  auto* gen_page_size = generate->add_option("--page-size", gen.cache.page_size, "tokens per cache page")
                            ->transform(whole_in("--page-size", 1, 4096));
  auto* gen_delta = generate->add_option("--delta", gen.cache.delta,
                                         "request-level failure budget of the Tier-B certificate, in (0, 1)")
                        ->check(real<double>("--delta", [](double v) { return v > 0 && v < 1; }, "in (0, 1)"));
  auto* gen_gate = add_meter_options(generate, gen.cache);
  auto* gen_granularity = generate->add_option("--granularity", gen.cache.granularity,
                                               "repair granularity of the gate: head, block or request")
                              ->check(choice("--granularity", {"head", "block", "request"}));
  auto* gen_dither = generate->add_option(
      "--dither", gen.cache.dither, "dithered keys: per-slot, shared-page, shared-prompt (default; docs/dither-cost.md) or none (RTN keys, deterministic bound, scalar path); per-slot also gives dithered values their own dither and Tier B (docs/tier-b.md)")
                         ->check(dither_mode("--dither"));
  auto* gen_shared_page = generate->add_flag("--shared-page-dither", gen.cache.shared_page_dither,
                                             "the same as --dither shared-page")
                              ->excludes(gen_dither);
  auto* gen_key_scales = add_key_scales_option(generate, gen.cache);
  auto* gen_dither_seed = generate->add_option("--dither-seed", gen.cache.dither_seed,
                                               "dithered keys and values: seed of the dither's Philox streams")
                              ->transform(seed("--dither-seed"));
  auto* gen_check = generate->add_flag("--check-soundness", gen.cache.check_soundness,
                                       "compare every meter with the true TV from the exact tier");
  auto* gen_meter_json = generate->add_option("--meter-json", gen.meter_json,
                                              "write every (layer, head, position) meter as JSON lines");
  generate->add_flag("--json", gen.json,
                     "print one JSON object on stdout (text, token counts, finish reason and the witcert object "
                     "serve returns) instead of streaming the text");
  const TierOptions gen_tier = add_tier_options(generate, gen.cache);

  witcert::apps::LogitsArgs lg;
  auto* logits = app.add_subcommand("logits", "Top-K next-token logits after a prompt, as JSON");
  add_prompt_options(logits, lg);
  logits->add_option("--top", lg.top, "how many candidates")->transform(whole_in("--top", 1, kMaxTokens));
  logits->add_option("--threads", lg.threads, "worker threads")->transform(whole_in("--threads", 1, 256));

  witcert::apps::RunArgs ra;
  auto* runc = app.add_subcommand("run", "One request under a KV format, gated or not, against fp16: quality, meter, page-ins");
  runc->add_option("prompt", ra.prompt, "prompt text")->required();
  runc->add_option("--model", ra.model, "GGUF model file (default: the fetched SmolLM2-135M)");
  auto* run_kv = runc->add_option("--kv", ra.cache.kv, "KV-cache format: fp16, dither-int4/5/6/8 or a scheme of `witcert schemes`");
  runc->add_option("--kv-v", ra.cache.kv_v, "format of the values (default: --kv)");
  auto* run_sweep = runc->add_option("--scheme-sweep", ra.scheme_sweep, "comma-separated formats, one run each, one table")
                        ->excludes(run_kv);
  auto* run_gate = add_meter_options(runc, ra.cache);
  auto* run_granularity = runc->add_option("--granularity", ra.cache.granularity, "repair granularity: head, block or request")
                              ->check(choice("--granularity", {"head", "block", "request"}));
  runc->add_option("--delta", ra.cache.delta, "Tier-B request-level failure budget in (0, 1)")->check(real<double>("--delta", [](double v) { return v > 0 && v < 1; }, "in (0, 1)"));
  runc->add_option("--n", ra.n, "tokens to generate")->transform(whole_in("--n", 1, kMaxTokens));
  runc->add_flag("--chat", ra.chat, "wrap the prompt as a user turn of the chat template");
  runc->add_flag("--check-soundness", ra.cache.check_soundness, "compare every meter with the true TV from the exact tier");
  runc->add_option("--report", ra.report, "directory for report.json, report.md, heatmaps and meter JSON lines");
  runc->add_flag("--json", ra.json, "print report.json's object on stdout instead of the texts and the table");
  runc->add_option("--telemetry-stride", ra.stride, "keep every N-th decode step's cells for the quantiles and JSON lines")
      ->transform(whole_in("--telemetry-stride", 1, kMaxTokens));
  const TierOptions run_tier = add_tier_options(runc, ra.cache);
  auto* run_dither = runc->add_option(
      "--dither", ra.cache.dither, "dithered keys: per-slot, shared-page, shared-prompt (default; docs/dither-cost.md) or none (RTN keys, deterministic bound, scalar path); per-slot also gives dithered values their own dither and Tier B (docs/tier-b.md)")
                         ->check(dither_mode("--dither"));
  auto* run_key_scales = add_key_scales_option(runc, ra.cache);
  runc->add_option("--threads", ra.threads, "worker threads")->transform(whole_in("--threads", 1, 256));

  std::string demo_model, demo_report = "out/demo";
  int demo_threads = 2, demo_tokens = 1500;
  auto* demo = app.add_subcommand("demo", "Needle retrieval under damaging and safe caches, raw and gated (the main job)");
  demo->add_option("--model", demo_model, "GGUF model file (default: the fetched SmolLM2-135M)");
  demo->add_option("--report", demo_report, "directory for the report");
  demo->add_option("--threads", demo_threads, "worker threads")->transform(whole_in("--threads", 1, 256));
  demo->add_option("--tokens", demo_tokens, "length of the haystack in tokens")->transform(whole_in("--tokens", 64, 7000));

  witcert::apps::BatchArgs ba;
  auto* batch = app.add_subcommand("batch", "Run JSON-lines requests together over one shared KV pool");
  batch->add_option("--model", ba.model, "GGUF model file (default: the fetched SmolLM2-135M)");
  batch->add_option("--input", ba.input, "requests, one JSON object a line: prompt or messages, max_tokens, "
                                          "temperature, top_p, seed, and with --kv tau, tau_v, granularity, delta, bound")
      ->required();
  batch->add_option("--output", ba.output, "results, one JSON line per request in input order")->required();
  batch->add_option("--threads", ba.threads, "worker threads")->transform(whole_in("--threads", 1, 256));
  batch->add_option("--max-seqs", ba.max_seqs, "sequences running at once")->transform(whole_in("--max-seqs", 1, 4096));
  batch->add_option("--max-tokens", ba.max_tokens, "max_tokens of a request that gives none")
      ->transform(whole_in("--max-tokens", 1, kMaxTokens));
  batch->add_option("--kv-memory", ba.kv_memory,
                    "bytes of the KV pool, measured from its allocations (e.g. 512M, 2G; default: room for the "
                    "--max-seqs largest requests)");
  batch->add_flag("--ignore-eos", ba.ignore_eos, "run every request to its max_tokens (benchmarks)");
  const PoolCacheOptions batch_cache = add_pool_cache_options(batch, ba.cache);

  witcert::apps::ServeArgs sa;
  auto* serve = app.add_subcommand("serve", "OpenAI-compatible HTTP server with the meter in every response and /metrics");
  serve->add_option("--model", sa.model, "GGUF model file (default: the fetched SmolLM2-135M)");
  serve->add_option("--host", sa.host, "address to bind (default 127.0.0.1: this machine only)");
  serve->add_option("--port", sa.port, "TCP port (0: any free port)")->transform(whole_in("--port", 0, 65535));
  serve->add_option("--api-key", sa.api_key, "require 'Authorization: Bearer KEY' on /v1 (/health, /metrics and / stay open)");
  serve->add_option("--threads", sa.threads, "worker threads")->transform(whole_in("--threads", 1, 256));
  serve->add_option("--max-seqs", sa.max_seqs, "sequences running at once")->transform(whole_in("--max-seqs", 1, 4096));
  serve->add_option("--max-tokens", sa.max_tokens, "max_tokens of a request that gives none")
      ->transform(whole_in("--max-tokens", 1, kMaxTokens));
  serve->add_option("--max-waiting", sa.max_waiting, "requests queued beyond the running batch; more get 503")
      ->transform(whole_in("--max-waiting", 1, 1000000));
  serve->add_option("--kv-memory", sa.kv_memory, "bytes of the KV pool, measured from its allocations (e.g. 512M, 2G)");
  serve->add_option("--max-body", sa.max_body, "largest request body (e.g. 1M); larger ones get 413");
  serve->add_option("--drain-seconds", sa.drain_seconds, "on SIGTERM/SIGINT, how long running requests may finish")
      ->check(CLI::Range(0.0, 3600.0));
  serve->add_option("--max-connections", sa.max_connections,
                    "connections open at once; one more is answered 503 (default: max(256, max-seqs + max-waiting + 64))")
      ->transform(whole_in("--max-connections", 1, 65536));
  serve->add_option("--header-timeout", sa.header_timeout,
                    "seconds a client has to send a request's headers (its body has 3x as long)")
      ->check(CLI::Range(0.1, 3600.0));
  const PoolCacheOptions serve_cache = add_pool_cache_options(serve, sa.cache);

  witcert::apps::EvalOptions ev;
  std::string ev_experiment;
  auto* evalc = app.add_subcommand("eval", "The paper's evaluation on this model: tables, CSVs and plots (docs/EVALUATION.md)");
  evalc->add_option("experiment", ev_experiment, "all, or one of: " + [] {
    std::string names;
    for (const std::string& n : witcert::apps::eval_experiments()) names += (names.empty() ? "" : ", ") + n;
    return names;
  }())->required();
  evalc->add_option("--model", ev.model, "GGUF model file (default: the fetched SmolLM2-135M)");
  evalc->add_option("--out", ev.out, "results directory (an experiment's cells already there are not recomputed)");
  evalc->add_option("--data", ev.data, "the corpus fetched by scripts/fetch-eval-data.sh");
  evalc->add_flag("--quick", ev.quick, "small sizes: minutes instead of hours");
  evalc->add_option("--threads", ev.threads, "worker threads")->transform(whole_in("--threads", 1, 256));
  evalc->add_option("--python", ev.python, "interpreter with matplotlib for the plots (default: .venv/bin/python, python3)");

  const std::vector<CLI::App*> commands = {bound, philox, schemes, selfcheck, generate, logits, runc, demo, batch, serve, evalc};
  try {
    if (argc > 1 && argv[1][0] != '-') {
      bool known = false;
      std::string names;
      for (const CLI::App* c : commands) {
        known = known || c->get_name() == argv[1];
        names += (names.empty() ? "" : ", ") + c->get_name();
      }
      if (!known) {
        std::vector<std::string> all;
        for (const CLI::App* c : commands) all.push_back(c->get_name());
        throw UsageError("unknown command '" + std::string(argv[1]) + "'" + did_you_mean(argv[1], all) +
                         " (commands: " + names + ")");
      }
    }
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help
      std::string hints;
      for (const CLI::App* c : commands)
        if (argc > 1 && c->get_name() == argv[1]) hints = flag_suggestions(*c, argc, argv);
      throw UsageError(e.what() + hints);
    }
    if (*generate) {
      if (!given(gen_kv))
        for (const CLI::Option* opt :
             {gen_kv_v, gen_tier.backing_file, gen_tier.overwrite, gen_tier.keep, gen_tier.exact_tier,
              generate->get_option("--bound"), generate->get_option("--tau-v"), generate->get_option("--coverage-tau"),
              gen_gate, gen_check, gen_dither, gen_shared_page, gen_key_scales, gen_dither_seed, gen_outliers, gen_page_size,
              gen_meter_json, gen_delta})
          if (given(opt))
            throw UsageError(opt->get_name() + " needs --kv: without it generate keeps a plain exact cache");
      check_dither_flags({gen_outliers, gen_dither, gen_shared_page, gen_key_scales, gen_dither_seed}, {gen.cache.kv},
                         "--kv");
      check_tier(gen_tier, gen.cache.exact_tier);
      if (given(gen_granularity) && !given(gen_gate)) throw UsageError("--granularity applies to a gate; give --tau-k");
      resolve_coverage_tau(gen.cache, generate->get_option("--coverage-tau"));
    }
    if (*batch) check_pool_cache_options(batch_cache, ba.cache, "batch");
    if (*serve) check_pool_cache_options(serve_cache, sa.cache, "serve");
    if (*batch) resolve_coverage_tau(ba.cache, batch_cache.coverage_tau);
    if (*serve) resolve_coverage_tau(sa.cache, serve_cache.coverage_tau);
    if (*serve && serve->count("--api-key") > 0 && sa.api_key.find_first_not_of(" \t") == std::string::npos)
      throw UsageError("--api-key is empty: give a key, or leave the flag out to serve without one");
    if (*runc) {
      check_dither_flags({run_dither, run_key_scales}, given(run_sweep) ? witcert::apps::split_list(ra.scheme_sweep) : std::vector{ra.cache.kv},
                         given(run_sweep) ? "--scheme-sweep" : "--kv");
      check_tier(run_tier, ra.cache.exact_tier);
      if (given(run_granularity) && !given(run_gate)) throw UsageError("--granularity applies to a gate; give --tau-k");
      resolve_coverage_tau(ra.cache, runc->get_option("--coverage-tau"));
    }
  } catch (const UsageError& e) {
    std::cerr << "witcert: error: " << e.what() << "\nwitcert: run 'witcert --help' for usage\n";
    return 2;
  }
  try {
    if (*bound) return witcert::apps::run_bound(std::cin, std::cout);
    if (*philox) return witcert::apps::run_philox(counter, key, std::cout);
    if (*schemes) return witcert::apps::run_schemes(std::cout);
    if (*selfcheck) return witcert::apps::run_selfcheck(std::cout);
    if (*generate) return witcert::apps::run_generate(gen, std::cout, std::cerr);
    if (*logits) return witcert::apps::run_logits(lg, std::cout);
    if (*runc) return witcert::apps::run_run(ra, std::cout, std::cerr);
    if (*batch) return witcert::apps::run_batch(ba, std::cerr);
    if (*serve) return witcert::apps::run_serve(sa, std::cerr);
    if (*evalc) return witcert::apps::run_eval(ev_experiment, ev, std::cout, std::cerr);
    if (*demo) return witcert::apps::run_demo(demo_model, demo_threads, demo_tokens, demo_report, std::cout, std::cerr);
  } catch (const std::exception& e) {
    std::cerr << "witcert: error: " << e.what() << "\n";
    return 2;
  }
  return 1;
}
