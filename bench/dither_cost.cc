// Per-slot vs shared-page dither on the real model (docs/dither-cost.md). For every prompt of a
// JSON-lines file ({"name": ..., "prompt": ...}, each wrapped as one chat turn), every dither
// mode and every dither seed, one request of two runs on the dither-int8 cache:
//   free    N decode steps, each next token chosen from the run's own logits: an adaptive
//           request, since the trajectory (and with a shared dither, the keys written into a
//           page) depends on the dither;
//   forced  the same N tokens fed as fixed input under an independent dither seed: the
//           non-adaptive control. Its next-token distributions at every position, against an
//           fp16 pass over the same tokens, give the KL divergence and the top-1 agreement.
// Every decode-step cell of both runs is checked against the true TV from the exact tier (the
// prefill cells too with --check-prefill); a request counts as violated if any of its
// decode-step cells is. The free runs sample at temperature 0.8 by default: greedy decoding
// of an 8-bit cache rarely leaves the fp16 trajectory, and a trajectory that never diverges
// shows little of the adaptivity under test. Every free run of seed k (fp16 and both modes)
// draws from the same sampler stream, so trajectories differ only through the cache. One JSON line per request goes to stdout;
// bench/dither_cost_table.py turns the lines into the table of docs/dither-cost.md.
//
//   build/witcert_dither_cost --prompts bench/dither_cost_prompts.jsonl --seeds 4 > out/dither_cost.jsonl
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "engine/cache_factory.h"
#include "engine/model.h"
#include "engine/session.h"
#include "gate/certified_cache.h"
#include "model/sampler.h"

namespace witcert {
namespace {

using json = nlohmann::json;

struct Args {
  std::string model, prompts;
  std::vector<int> select;  // prompt indices; empty: all
  std::vector<std::string> modes{"per-slot", "shared-page"};
  int seeds = 4, first_seed = 0, n = 32, threads = 2, chunk = 64;
  float temperature = 0.8f;
  std::uint64_t sample_seed = 1;
  double tau = 0.2, delta = 1e-2;
  bool check_prefill = false, replay_check = false;
  bool cross_mode = false;  // the forced control under the other dither mode (cross_mode_of)
};

// The mode a forced control runs under with --cross-mode: a free run's trajectory fed under the
// other mode's dither, which shows whether its high-meter cells come with the trajectory.
kvcache::DitherMode cross_mode_of(kvcache::DitherMode mode) {
  return mode == kvcache::DitherMode::per_slot ? kvcache::DitherMode::shared_page : kvcache::DitherMode::per_slot;
}

// The tokens after the prompt and, when kept, the next-token log-probabilities at every
// position of prompt + continuation.
struct Pass {
  std::vector<std::int32_t> continuation;
  std::vector<float> log_probs;
};

void log_softmax(std::span<const float> logits, float* out) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  double z = 0.0;
  for (float l : logits) z += std::exp(static_cast<double>(l) - mx);
  const double lz = std::log(z) + mx;
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<float>(logits[i] - lz);
}

// The prompt in chunks, then n one-token steps, each feeding forced[i] or, without forced, the
// token the sampler picks from the previous logits. Free and forced runs take this one path,
// so a trajectory fed back under the dither that produced it reproduces the free run exactly.
// on_decode runs once, between the prompt and the first step.
Pass run_pass(const model::LlamaModel& m, kvcache::KvCache& cache, ThreadPool& pool, const std::vector<std::int32_t>& prompt,
              int n, const std::vector<std::int32_t>* forced, const model::SamplerConfig& sampling, bool keep_log_probs,
              int chunk, const std::function<void()>& on_decode = {}) {
  const int V = m.config().vocab;
  const std::int64_t P = static_cast<std::int64_t>(prompt.size());
  model::Sampler sampler(sampling);
  engine::Session session(m, cache, pool, chunk);
  Pass pass;
  if (keep_log_probs) pass.log_probs.resize(static_cast<std::size_t>(P + n) * V);
  const auto keep = [&](std::int64_t pos, std::span<const float> row) { log_softmax(row, &pass.log_probs[pos * V]); };
  std::span<const float> last = session.prefill(prompt, {}, keep_log_probs ? engine::LogitsSink(keep) : engine::LogitsSink());
  if (on_decode) on_decode();
  for (int i = 0; i < n; ++i) {
    const std::int32_t next = forced ? (*forced)[i] : sampler.sample(last);
    pass.continuation.push_back(next);
    last = session.step(next);
    if (keep_log_probs) keep(P + i, last);
  }
  return pass;
}

struct Tally {
  long cells = 0, violations = 0, covered = 0, prefill_cells = 0, prefill_violations = 0;
  double worst_ratio = 0.0, max_tv = 0.0;
  std::vector<double> meters;  // of the decode-step cells: how far below τ coverage is
};

// Decode-step cells (positions ≥ the prompt's length) are the request's; prefill cells are
// non-adaptive in every mode and are counted apart.
Tally tally(const std::vector<gate::MeterCell>& cells, std::int64_t prompt_len, double tau) {
  Tally t;
  for (const gate::MeterCell& c : cells) {
    if (std::isnan(c.tv)) continue;  // not checked
    const bool violated = !(c.tv <= c.meter * (1 + 1e-9) + 1e-12);  // the tolerance of `witcert generate`
    if (c.pos < prompt_len) {
      ++t.prefill_cells;
      t.prefill_violations += violated;
      continue;
    }
    ++t.cells;
    t.violations += violated;
    t.covered += c.meter <= tau;
    if (c.meter > 0) t.worst_ratio = std::max(t.worst_ratio, c.tv / c.meter);
    t.max_tv = std::max(t.max_tv, c.tv);
    t.meters.push_back(c.meter);
  }
  std::sort(t.meters.begin(), t.meters.end());
  return t;
}

json to_json(const Tally& t) {
  return {{"cells", t.cells},
          {"violations", t.violations},
          {"covered", t.covered},
          {"worst_ratio", t.worst_ratio},
          {"max_tv", t.max_tv},
          {"meter_median", t.meters.empty() ? 0.0 : t.meters[t.meters.size() / 2]},
          {"meter_max", t.meters.empty() ? 0.0 : t.meters.back()},
          {"prefill_cells", t.prefill_cells},
          {"prefill_violations", t.prefill_violations}};
}

bool same_cells(std::vector<gate::MeterCell> a, std::vector<gate::MeterCell> b) {
  const auto key = [](const gate::MeterCell& c) { return std::tuple(c.pos, c.layer, c.q_head); };
  const auto by_key = [&](const gate::MeterCell& x, const gate::MeterCell& y) { return key(x) < key(y); };
  std::sort(a.begin(), a.end(), by_key);
  std::sort(b.begin(), b.end(), by_key);
  const auto same = [](double x, double y) { return x == y || (std::isnan(x) && std::isnan(y)); };  // NaN: unchecked
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [&](const gate::MeterCell& x, const gate::MeterCell& y) {
    return key(x) == key(y) && same(x.eform_raw, y.eform_raw) && same(x.meter, y.meter) && same(x.tv, y.tv);
  });
}

int run(const Args& args) {
  engine::Model engine = engine::Model::load(args.model.empty() ? engine::default_model_path() : args.model);
  const model::LlamaModel& m = *engine.model;
  const model::LlamaConfig& cfg = m.config();
  std::ifstream in(args.prompts);
  if (!in) throw std::runtime_error("cannot read '" + args.prompts + "'");
  std::vector<json> prompts;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) prompts.push_back(json::parse(line));
  std::vector<kvcache::DitherMode> modes;
  for (const std::string& mode : args.modes) modes.push_back(kvcache::parse_dither_mode(mode));
  ThreadPool pool(args.threads);
  const int V = cfg.vocab;

  for (std::size_t pi = 0; pi < prompts.size(); ++pi) {
    if (!args.select.empty() && std::find(args.select.begin(), args.select.end(), static_cast<int>(pi)) == args.select.end())
      continue;
    const std::vector<std::int32_t> prompt = engine.prompt_tokens(prompts[pi].at("prompt").get<std::string>(), true);
    const std::int64_t P = static_cast<std::int64_t>(prompt.size()), capacity = P + args.n;
    attention::ExactKvCache exact(cfg.kv_geometry(capacity));

    // The decode steps' soundness check reads the exact tier: built with the check on, which is
    // then off for the prompt unless --check-prefill (set_check_soundness before each decode).
    const auto certified = [&](kvcache::DitherMode mode, std::uint64_t seed, gate::CellLog& log) {
      engine::CacheOptions o;
      o.certified = true;
      o.k_format = o.v_format = formats::KvFormat::dither();
      o.dither_seed = seed;
      o.dither = mode;
      o.delta = args.delta;
      o.check_soundness = true;
      engine::Cache c = engine::make_cache(cfg, capacity, args.n, o, {&log});
      c.certified->set_check_soundness(args.check_prefill);
      return c;
    };

    for (int k = args.first_seed; k < args.first_seed + args.seeds; ++k) {
      const model::SamplerConfig sampling{args.temperature, 1.0f, args.sample_seed + static_cast<std::uint64_t>(k)};
      exact.clear();
      const Pass fp16 = run_pass(m, exact, pool, prompt, args.n, nullptr, sampling, false, args.chunk);
      for (const kvcache::DitherMode mode : modes) {
        const auto t0 = std::chrono::steady_clock::now();
        const std::uint64_t free_seed = 0x5EED0000ull + k, forced_seed = 0xF0CED000ull + k;
        gate::CellLog free_log;
        auto free_cache = certified(mode, free_seed, free_log);
        const auto check_decode = [&](gate::CertifiedKvCache& c) { return [&c] { c.set_check_soundness(true); }; };
        const Pass free = run_pass(m, *free_cache.kv, pool, prompt, args.n, nullptr, sampling, false, args.chunk,
                                   check_decode(*free_cache.certified));
        const auto diverged = std::mismatch(free.continuation.begin(), free.continuation.end(), fp16.continuation.begin());
        json rec = {{"prompt", prompts[pi].value("name", std::to_string(pi))},
                    {"mode", kvcache::dither_mode_name(mode)},
                    {"prompt_tokens", P},
                    {"decode_steps", args.n},
                    {"temperature", args.temperature},
                    {"sample_seed", sampling.seed},
                    {"free_seed", free_seed},
                    {"forced_seed", forced_seed},
                    {"free", to_json(tally(free_log.cells(), P, args.tau))},
                    {"diverged_at", diverged.first == free.continuation.end()
                                        ? json(nullptr)
                                        : json(diverged.first - free.continuation.begin())}};
        if (args.replay_check && k == args.first_seed) {
          // The free run is the forced run of its own trajectory under its own dither: the
          // premise of the union over trajectories in docs/dither-cost.md.
          gate::CellLog replay_log;
          auto replay = certified(mode, free_seed, replay_log);
          run_pass(m, *replay.kv, pool, prompt, args.n, &free.continuation, sampling, false, args.chunk,
                   check_decode(*replay.certified));
          rec["replay_identical"] = same_cells(free_log.cells(), replay_log.cells());
        }
        free_cache.kv.reset();

        exact.clear();
        const Pass ref = run_pass(m, exact, pool, prompt, args.n, &free.continuation, sampling, true, args.chunk);
        gate::CellLog forced_log;
        const kvcache::DitherMode forced_mode = args.cross_mode ? cross_mode_of(mode) : mode;
        rec["forced_mode"] = kvcache::dither_mode_name(forced_mode);
        auto forced_cache = certified(forced_mode, forced_seed, forced_log);
        const Pass forced = run_pass(m, *forced_cache.kv, pool, prompt, args.n, &free.continuation, sampling, true,
                                     args.chunk, check_decode(*forced_cache.certified));
        double kl_sum = 0.0, kl_max = 0.0;
        long agree = 0;
        const std::int64_t positions = P + args.n;
        for (std::int64_t p = 0; p < positions; ++p) {
          const float* a = &ref.log_probs[p * V];
          const float* b = &forced.log_probs[p * V];
          double kl = 0.0;
          for (int i = 0; i < V; ++i) kl += std::exp(static_cast<double>(a[i])) * (static_cast<double>(a[i]) - b[i]);
          kl_sum += kl;
          kl_max = std::max(kl_max, kl);
          agree += std::max_element(a, a + V) - a == std::max_element(b, b + V) - b;
        }
        rec["forced"] = to_json(tally(forced_log.cells(), P, args.tau));
        rec["quality"] = {{"positions", positions}, {"kl_mean", kl_sum / positions}, {"kl_max", kl_max},
                          {"top1_agree", agree}};
        rec["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::cout << rec.dump() << std::endl;
        std::cerr << fmt::format("{} {} seed {}: free {} / {} cells violated (diverged at {}), forced {} / {}, {:.0f} s\n",
                                 rec["prompt"].get<std::string>(), kvcache::dither_mode_name(mode), k, rec["free"]["violations"].get<long>(),
                                 rec["free"]["cells"].get<long>(), rec["diverged_at"].dump(),
                                 rec["forced"]["violations"].get<long>(), rec["forced"]["cells"].get<long>(),
                                 rec["seconds"].get<double>());
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace witcert

int main(int argc, char** argv) {
  witcert::Args args;
  CLI::App app{"Per-slot vs shared-page dither on the real model: violations free and forced, coverage, KL, top-1"};
  app.add_option("--model", args.model, "GGUF model file (default: the fetched SmolLM2-135M)");
  app.add_option("--prompts", args.prompts, "JSON lines {\"name\": ..., \"prompt\": ...}")->required();
  app.add_option("--select", args.select, "prompt indices to run (default: all)");
  app.add_option("--modes", args.modes, "dither modes: per-slot, shared-page, shared-prompt");
  app.add_option("--seeds", args.seeds, "dither seeds per prompt and mode")->check(CLI::PositiveNumber);
  app.add_option("--first-seed", args.first_seed, "the first seed index k (seeds k, k + 1, ...; disjoint runs take disjoint ranges)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--cross-mode", args.cross_mode,
               "run the forced control under the other dither mode (per-slot <-> shared-page; shared-prompt -> per-slot)");
  app.add_option("--n", args.n, "decode steps per request")->check(CLI::PositiveNumber);
  app.add_option("--temp", args.temperature, "sampling temperature of the free runs (0: greedy)");
  app.add_option("--sample-seed", args.sample_seed,
                 "sampler seed of seed 0 (seed k uses this + k), shared by the fp16 and the free runs");
  app.add_option("--tau", args.tau, "meter threshold for coverage");
  app.add_option("--delta", args.delta, "request-level failure budget");
  app.add_option("--threads", args.threads, "worker threads")->check(CLI::PositiveNumber);
  app.add_flag("--check-prefill", args.check_prefill, "also check every prefill cell against the true TV");
  app.add_flag("--replay-check", args.replay_check,
               "feed the first seed's free trajectory back under its own dither and compare every cell");
  CLI11_PARSE(app, argc, argv);
  try {
    return witcert::run(args);
  } catch (const std::exception& e) {
    std::cerr << "witcert_dither_cost: error: " << e.what() << "\n";
    return 2;
  }
}
