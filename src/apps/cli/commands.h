// The witcert subcommands. Each reads its input from the given streams so that tests can
// drive it without a process, and returns the process exit code.
#pragma once

#include <array>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "engine/options.h"

namespace witcert::apps {

// `witcert bound`: JSON lines {"p_tilde": [...], "c": [...], "eps": [...]?} → one JSON line of
// bounds each, or {"line": N, "error": "..."}. Non-zero if any line failed.
int run_bound(std::istream& in, std::ostream& out);

// `witcert philox`: parses "A,B,C,D" / "K0,K1" (decimal or 0x-hex words) and prints the four
// output words as 8-digit hex. Throws std::invalid_argument on malformed words.
std::array<std::uint32_t, 4> parse_words4(const std::string& text);
std::array<std::uint32_t, 2> parse_words2(const std::string& text);
int run_philox(const std::string& counter, const std::string& key, std::ostream& out);

// `witcert schemes`: the KV scheme registry (Tier A) and dither-int8 (Tier B, m = 0 and 4 outlier
// pairs), one row each with its kind and its measured bytes per token per head for keys and
// values at head_dim 64 and 128.
int run_schemes(std::ostream& out);

// `witcert selfcheck`: the counterexample table of paper §3 and the known-answer checks.
int run_selfcheck(std::ostream& out);

// The command line's cache, meter and gate flags, shared by generate and run, as typed into
// engine::CacheOptions by cache_options (the one place their words are parsed).
struct CacheFlags {
  std::string kv;    // "" → the plain exact cache (generate) or an error (run)
  std::string kv_v;  // "" → the same as kv
  int outliers = 4;
  int page_size = 16;
  double delta = 1e-2;
  double gate = 0.0;  // τ_K of the gate; 0: no gate
  std::string granularity = "block";
  double tau_v = 0.05;         // the V-side threshold of the joint gate and of the V coverage figure
  // The meter threshold of the coverage figure, as main resolves it (engine::coverage_tau):
  // --coverage-tau when given, else a certified --gate's τ_K, else the default.
  double coverage_tau = engine::kDefaultCoverageTau;
  std::string bound = "min";   // the meter's bound shape
  bool shared_page_dither = false;
  std::string dither = "shared-prompt";  // kvcache::parse_dither_mode
  std::string key_scales = "token";      // formats::parse_scale_granularity
  std::uint64_t dither_seed = 0x5EED;  // the Philox key of the key dither (CacheConfig::seed)
  bool check_soundness = false;
  std::string backing_file;  // "" keeps the exact tier in a private temporary file (or RAM)
  bool backing_file_overwrite = false;  // replace an existing backing_file
  bool keep_backing_file = false;       // leave backing_file in place at exit
  std::string exact_tier = "file";      // where an unnamed exact tier lives: "file" (private temp dir) or "ram"
};

// Where the exact tier lives, from the command line: `file` "" → a private temporary file (or RAM
// when exact_tier is "ram"). Throws std::invalid_argument when a named file would be useless (no
// gate or soundness check reads the tier: `needed` false) or is the model itself.
kvcache::BackingPlace backing_place(const std::string& file, bool overwrite, bool keep, const std::string& exact_tier,
                                  const std::string& model_path, bool needed);

// The cache options of `flags` with keys in `kv` (a run of --scheme-sweep names its own) and the
// exact tier placed away from the model file. Throws std::invalid_argument for an unknown format,
// mode or shape and for settings CacheOptions::validate rejects.
engine::CacheOptions cache_options(const CacheFlags& flags, const std::string& kv, const std::string& model_path);

struct GenerateArgs {
  std::string model;  // "" → default_model_path()
  std::string prompt;
  bool chat = false;
  int n = 128;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;  // 0: every token
  std::uint64_t seed = 0;
  int threads = 2;
  CacheFlags cache;  // an empty kv keeps the plain exact cache
  std::string meter_json;
  bool json = false;  // one JSON object on out instead of the streamed text
};

// `witcert generate`: streams the continuation to out (or, with json, prints one JSON object when
// done), then prefill and decode tokens/s and the meter's summary to err.
int run_generate(const GenerateArgs& args, std::ostream& out, std::ostream& err);

struct BatchArgs {
  std::string model;  // "" → default_model_path()
  std::string input, output;  // JSON lines
  int threads = 2;
  int max_seqs = 16;
  int max_tokens = 128;    // a request's default max_tokens
  std::string kv_memory;   // "" → room for the max_seqs largest requests; else bytes, 512M, 2G
  bool ignore_eos = false; // run every request to its max_tokens (benchmarks)
  CacheFlags cache;        // an empty kv keeps the plain exact cache
};

// `witcert batch`: runs every request of args.input together over one KV pool and writes one
// result line per request, in input order, to args.output; progress and totals go to err.
int run_batch(const BatchArgs& args, std::ostream& err);
// A byte count: digits with an optional unit K, M or G (powers of 1024). Throws std::invalid_argument.
std::int64_t parse_bytes(const std::string& text);

struct ServeArgs {
  std::string model;  // "" → default_model_path()
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;
  int threads = 2;
  int max_seqs = 16;
  int max_tokens = 256;        // a request's default max_tokens
  int max_waiting = 64;        // queued requests beyond which the server answers 503
  std::string kv_memory = "512M";
  std::string max_body = "1M";  // request bodies above it get 413
  double drain_seconds = 30.0;  // on SIGTERM/SIGINT: how long running requests may finish
  int max_connections = 0;      // 0: max(256, max_seqs + max_waiting + 64)
  double header_timeout = 10.0;  // seconds for a request's headers; its body gets three times as long
  CacheFlags cache;             // an empty kv keeps the plain exact cache
};

// `witcert serve`: the OpenAI-compatible server until SIGINT/SIGTERM; status lines go to err.
int run_serve(const ServeArgs& args, std::ostream& err);

struct LogitsArgs {
  std::string model;
  std::string prompt;
  bool chat = false;
  int top = 10;
  int threads = 2;
};

struct RunArgs {
  std::string model;
  std::string prompt;
  bool chat = false;
  int n = 32;
  CacheFlags cache;
  std::string scheme_sweep;  // comma-separated formats: one run each, one table
  int stride = 1;      // telemetry sampling stride in decode steps
  std::string report;  // directory
  int threads = 2;
  bool json = false;   // one JSON object on out (report.json's) instead of the texts and the table
};

// The words of a comma-separated list, as `witcert run --scheme-sweep` splits it (empty words dropped).
std::vector<std::string> split_list(const std::string& s);

// `witcert run`: fp16 vs the given format(s), gated or not: texts, quality, meter, page-ins.
int run_run(const RunArgs& args, std::ostream& out, std::ostream& err);

// `witcert demo`: the needle-retrieval demo of the README's main job.
int run_demo(const std::string& model, int threads, int tokens, const std::string& report, std::ostream& out,
             std::ostream& err);

// `witcert logits`: the top-K next-token ids, pieces and logits after the prompt, as JSON.
int run_logits(const LogitsArgs& args, std::ostream& out);

}  // namespace witcert::apps
