// `witcert eval`: the paper's evaluation on the model at hand (docs/EVALUATION.md). Each experiment
// writes under OUT/<experiment>/ the raw results as JSON lines (results.jsonl, one line per
// finished cell, so that a rerun skips them), a CSV and a markdown table, and plots (PNG and SVG,
// drawn by matplotlib from the CSVs). Every experiment that computes a meter checks every cell it
// counts against the true TV from the exact tier and reports the violations.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/terminal.h"
#include "engine/model.h"

namespace witcert::apps {

struct EvalOptions {
  std::string model;              // GGUF; "" → the default model
  std::string out = "out/eval";   // results go to out/<experiment>/
  std::string data = "data/eval"; // the corpus (scripts/fetch-eval-data.sh)
  bool quick = false;             // minutes instead of the full sizes
  int threads = 2;
  std::string python;             // the interpreter that draws the plots; "" → .venv/bin/python, then python3
};

// The experiments `witcert eval` knows, in the order `all` runs them.
std::vector<std::string> eval_experiments();

// Runs one experiment, or every one for "all". Throws std::invalid_argument for an unknown name.
int run_eval(const std::string& experiment, const EvalOptions& opts, std::ostream& out, std::ostream& err);

namespace eval {

// A needle-in-a-haystack prompt, as `witcert demo` and the needle experiments write it: "Read the
// following text carefully.", ordinary sentences of the haystack (indices into its 16 sentences,
// cycled in `order`) until `before_tokens`, the needle, more sentences until `target_tokens` in
// all, then "Question: " and the question.
std::string needle_text(const engine::Model& m, int before_tokens, int target_tokens, const std::string& needle,
                        const std::string& question, const std::vector<int>& order);

// The finished cells of an experiment, one JSON object per line with a unique "key"; a rerun
// loads them and skips what is there. A torn last line (a run killed mid-write) is dropped.
class ResultStore {
 public:
  explicit ResultStore(std::string path);
  bool has(const std::string& key) const { return rows_.count(key) != 0; }
  const nlohmann::json& get(const std::string& key) const { return rows_.at(key); }
  // Appends and flushes one cell's record (its "key" is set to key).
  void put(const std::string& key, nlohmann::json record);
  std::size_t size() const { return rows_.size(); }

 private:
  std::string path_;
  std::map<std::string, nlohmann::json> rows_;
};

// A progress bar over cells with elapsed time and an ETA from the cells computed in this run
// (cells loaded from a previous run count as done but not in the rate). On a terminal it is one
// line redrawn in place; in a log, a line at each tenth of the cells and none with a carriage return.
class EtaBar {
 public:
  EtaBar(std::ostream& err, std::string label, std::int64_t total, bool terminal = stderr_is_terminal());
  void skip();     // a cell found in the store
  void advance();  // a cell computed now
  void finish();

 private:
  void draw();
  std::ostream& err_;
  std::string label_;
  std::int64_t total_, done_ = 0, computed_ = 0;
  double start_;
  bool terminal_;
};

// "1h02m", "3m07s", "12s".
std::string format_duration(double seconds);

// Writes dir/name.csv and dir/name.md from rows: the columns in order; numbers as they are in
// the JSON, strings quoted in the CSV where needed.
void write_table(const std::string& dir, const std::string& name, const std::vector<std::string>& columns,
                 const std::vector<nlohmann::json>& rows, const std::string& title);

// The area under the ROC curve of score as a classifier of positive (ties count one half): the
// probability that a random positive scores above a random negative. NaN without both classes.
double auroc(const std::vector<double>& score, const std::vector<bool>& positive);

// The ROC curve's points (false positive rate, true positive rate) at every distinct threshold,
// from (0, 0) to (1, 1).
std::vector<std::pair<double, double>> roc_curve(const std::vector<double>& score, const std::vector<bool>& positive);

// With zero failures in n independent trials, the one-sided 95 % upper bound on the failure rate
// (the rule of three, 3/n; exactly 1 − 0.05^{1/n}).
double rule_of_three(std::int64_t n);

// Percentile p ∈ [0, 1] of values (nearest rank); NaN when empty.
double percentile(std::vector<double> values, double p);

// Paired bootstrap: the 95 % interval of mean(b − a) over `resamples` resamples of the pairs.
std::pair<double, double> paired_bootstrap_ci(const std::vector<double>& a, const std::vector<double>& b,
                                              int resamples, std::uint64_t seed);

// McNemar's exact test of paired binary outcomes: the two-sided p-value from the discordant
// counts (b01: a wrong, b right; b10: a right, b wrong).
double mcnemar_p(std::int64_t b01, std::int64_t b10);

// Prompts of one domain: "prose" and "code" are windows of `tokens` tokens of the corpus under
// opts.data at offsets drawn from `seed`; a missing corpus throws with the fetch command.
std::vector<std::string> domain_prompts(const engine::Model& m, const EvalOptions& opts, const std::string& domain,
                                        int count, int tokens, std::uint64_t seed);

// Draws the experiment's plots with matplotlib from its CSVs (the script is compiled in). Returns
// the files written; throws when no interpreter with matplotlib is found.
std::vector<std::string> draw_plots(const EvalOptions& opts, const std::string& experiment, const std::string& dir);

}  // namespace eval
}  // namespace witcert::apps
