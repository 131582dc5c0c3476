// What the experiments of `witcert eval` share: the sinks that check and sample cells, one checked
// request, the needle prompts, and each experiment's entry point (one file per group of them).
#pragma once

#include <cmath>
#include <cstdint>
#include <mutex>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "apps/eval/eval.h"
#include "base/thread_pool.h"
#include "engine/model.h"
#include "engine/options.h"
#include "gate/meter_cell.h"
#include "kvcache/kv_store.h"

namespace witcert::apps::eval {

// The paper's coverage thresholds (§5): τ_K = 0.2, τ_V = 0.05.
inline constexpr double kTauK = 0.2, kTauV = 0.05;

// Every cell's soundness, from the calling threads: counts, violations (true TV above the meter),
// the worst ratio TV / meter, and the cells of the decode steps (pos ≥ first) whose true TV
// exceeds 0.2 (the paper's "danger").
class SoundnessSink final : public gate::MeterSink {
 public:
  explicit SoundnessSink(std::int64_t first = 0) : first_(first) {}
  void record(std::span<const gate::MeterCell> cells) override;
  std::int64_t checked = 0, violations = 0, decode_checked = 0, dangerous = 0;
  double worst_ratio = 0.0, max_tv = 0.0;
  double worst_v_ratio = 0.0;  // the values' true error over the V meter, at most 1 when sound

 private:
  std::mutex mu_;
  std::int64_t first_;
};

// Keeps every k-th checked cell of the decode steps (pos ≥ first): raw score, meter and true TV.
class CellSample final : public gate::MeterSink {
 public:
  CellSample(std::int64_t first, int every) : first_(first), every_(every) {}
  void record(std::span<const gate::MeterCell> cells) override;
  struct Cell {
    double raw, meter, tv;
  };
  std::vector<Cell> kept;

 private:
  std::mutex mu_;
  std::int64_t first_;
  int every_;
  std::int64_t seen_ = 0;
};

// Joint K∧V coverage at (τ_K, τ_V) of the decode-step cells (pos ≥ first): as served (after the
// step's repair), before the step's repair, and before it under the e-form (the clamped raw score)
// with the same V meter.
class CoverageSink final : public gate::MeterSink {
 public:
  CoverageSink(std::int64_t first, double tau_k, double tau_v) : first_(first), tau_k_(tau_k), tau_v_(tau_v) {}
  void record(std::span<const gate::MeterCell> cells) override;
  std::int64_t cells() const { return cells_; }
  double served() const { return ratio(served_); }
  double before() const { return ratio(before_); }
  double eform_before() const { return ratio(eform_); }

 private:
  double ratio(std::int64_t n) const { return cells_ ? double(n) / double(cells_) : 0.0; }
  std::mutex mu_;
  std::int64_t first_;
  double tau_k_, tau_v_;
  std::int64_t cells_ = 0, served_ = 0, before_ = 0, eform_ = 0;
};

// The certified cache of one KV format (both sides) with the soundness check on.
engine::CacheOptions checked_cache(const std::string& kv);

// What a table's caption says of the bound shape its meters and coverage use: "bound shape of the
// meter and coverage: min of sound forms".
std::string bound_caption(cert::BoundShape shape);

// Greedy generation of n tokens from prompt on a cache of `opts` (certified or plain) with the
// sinks, or fewer at the model's stop token when `stop`: the tokens (stop token excluded) and the
// pages its gate read from the exact tier. With opts.check_soundness, every cell is checked, or
// only the decode steps' when !check_prompt (the prompt's cells cost O(S²) to check).
struct CheckedRun {
  std::vector<std::int32_t> tokens;
  kvcache::KvStore::PageInStats page_in;
};
CheckedRun run_checked(const engine::Model& m, ThreadPool& pool, const std::vector<std::int32_t>& prompt, int n,
                       const engine::CacheOptions& opts, std::vector<gate::MeterSink*> sinks = {}, bool stop = false,
                       bool check_prompt = true);

std::string experiment_dir(const EvalOptions& o, const std::string& name);

// Prints the experiment's table, draws its plots and says its violations.
void finish(const EvalOptions& o, const std::string& name, const std::string& dir, std::ostream& out,
            std::int64_t violations);

// Schemes whose meter is a certificate: every KV format but the exact fp16.
std::vector<std::string> metered_schemes();

// A seeded needle-in-a-haystack prompt: a passphrase sentence at a depth of the haystack, then
// the question; the request is correct when its answer contains `answer`.
struct NeedlePrompt {
  std::string text, answer;
  int target_tokens = 0;
  double depth = 0.0;  // where the needle sits, as a fraction of the haystack
};
// count prompts from seed, lengths in [min_tokens, max_tokens] (of the haystack) and depths in
// [0.1, 0.9], each with its own passphrase.
std::vector<NeedlePrompt> needle_prompts(const engine::Model& m, int count, int min_tokens, int max_tokens,
                                         std::uint64_t seed);

// Whether text contains answer.
bool answered(const std::string& text, const std::string& answer);

// The Table 5 control of the outlier bypass on synthetic keys with 4 massive RoPE pairs: one row
// per treatment (no bypass; bypassed but left in the amax; bypassed and excluded), adding the
// queries whose true TV exceeds the meter to violations.
std::vector<nlohmann::json> outlier_control(const EvalOptions& o, std::int64_t& violations);

// The experiments; each returns its soundness violations.
using Experiment = std::int64_t (*)(const engine::Model&, const EvalOptions&, std::ostream& out, std::ostream& err);
std::int64_t soundness(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);
std::int64_t schemes(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);
std::int64_t shapes(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);
std::int64_t outliers(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);
std::int64_t risk_coverage(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);
std::int64_t needle(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);
std::int64_t danger(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);
std::int64_t layer_pollution(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);
std::int64_t quality(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);
std::int64_t below8(const engine::Model&, const EvalOptions&, std::ostream&, std::ostream&);

}  // namespace witcert::apps::eval
