// `witcert batch`: JSON lines of requests in, JSON lines of results out in input order, all
// requests run together over one shared KV pool (engine/batch.h).
#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/cli/commands.h"
#include "apps/serve/request.h"
#include "engine/batch.h"
#include "engine/model.h"

namespace witcert::apps {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// One input line as a request. Keys: prompt (text) or messages ([{role, content}], rendered by
// the model's chat template), max_tokens, temperature, top_p, seed, and with a certified cache
// the request's policy: tau (τ_K of the gate), tau_v, granularity, delta, bound, coverage_tau,
// coverage_tau_v. id is echoed. Anything else is an error naming the key.
engine::BatchRequest parse_request(const nlohmann::json& j, const engine::Model& m, const engine::CacheOptions& base,
                                   const BatchArgs& args) {
  require(j.is_object(), "a request is a JSON object");
  static const std::vector<std::string> known = {"id",  "prompt", "messages", "max_tokens", "temperature", "top_p",
                                                 "seed", "tau",   "tau_v",    "granularity", "delta",      "bound",
                                                 "coverage_tau", "coverage_tau_v"};
  for (const auto& [key, value] : j.items())
    require(std::find(known.begin(), known.end(), key) != known.end(), "unknown key '" + key + "'");
  require(j.contains("prompt") != j.contains("messages"), "give either prompt or messages");
  engine::BatchRequest r;
  if (j.contains("prompt")) {
    std::string text;
    engine::read_json(j, "prompt", text);
    r.prompt = m.prompt_tokens(text, false);
  } else {
    r.prompt = m.tokenizer->encode(m.tokenizer->apply_chat_template(chat_messages(j.at("messages")), true), true);
  }
  r.max_tokens = args.max_tokens;
  engine::read_json(j, "max_tokens", r.max_tokens);
  require(r.max_tokens >= 1 && r.max_tokens <= 1000000, "max_tokens must be in [1, 1000000], got " + std::to_string(r.max_tokens));
  engine::read_json(j, "temperature", r.sampler.temperature);
  engine::read_json(j, "top_p", r.sampler.top_p);
  engine::read_json(j, "seed", r.sampler.seed);
  apply_policy(j, base, args.cache.coverage_tau, args.cache.tau_v, r);
  return r;
}

}  // namespace

std::int64_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double v = 0.0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument("'" + text + "' is not a byte count (e.g. 536870912, 512M, 2G)");
  }
  const std::string unit = text.substr(used);
  double scale = 1.0;
  if (unit == "K" || unit == "KiB" || unit == "k") scale = 1024.0;
  else if (unit == "M" || unit == "MiB") scale = 1024.0 * 1024.0;
  else if (unit == "G" || unit == "GiB") scale = 1024.0 * 1024.0 * 1024.0;
  else if (!unit.empty() && unit != "B") throw std::invalid_argument("'" + text + "': unknown unit '" + unit + "' (K, M or G)");
  const double bytes = v * scale;
  if (!std::isfinite(bytes) || bytes < 1 || bytes > 9.0e18)
    throw std::invalid_argument("'" + text + "' is not a positive byte count");
  return static_cast<std::int64_t>(bytes);
}

namespace {

int run_batch_to(const BatchArgs& args, const std::string& tmp, std::ostream& err) {
  const std::string model_path = args.model.empty() ? engine::default_model_path() : args.model;
  const engine::CacheOptions base = cache_options(args.cache, args.cache.kv, model_path);
  engine::BatchOptions bo;
  bo.max_seqs = args.max_seqs;
  bo.kv_memory = args.kv_memory.empty() ? 0 : parse_bytes(args.kv_memory);
  bo.validate();
  std::error_code ec;
  if (std::filesystem::exists(args.output) && std::filesystem::equivalent(args.input, args.output, ec))
    throw std::invalid_argument("--output is the --input file; refusing to overwrite it");

  engine::Model m = engine::Model::load(model_path);
  std::ifstream in(args.input);
  if (!in) throw std::runtime_error("cannot read '" + args.input + "'");
  std::vector<engine::BatchRequest> requests;
  std::vector<std::string> errors;
  std::vector<nlohmann::json> ids;
  std::vector<std::size_t> lines;  // the input line of each request
  std::string line;
  for (std::size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are not requests
    nlohmann::json id;
    try {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.is_object() && j.contains("id")) id = j.at("id");
      requests.push_back(parse_request(j, m, base, args));
      errors.emplace_back();
    } catch (const std::exception& e) {
      requests.emplace_back();  // runs nothing: its error is reported in its place
      errors.push_back(fmt::format("line {}: {}", n, e.what()));
    }
    ids.push_back(id);
    lines.push_back(n);
  }
  require(!requests.empty(), "'" + args.input + "' holds no requests");

  ThreadPool pool(args.threads);
  engine::BatchEngine engine(*m.model, pool, base, bo);
  // Requests that failed to parse take their line's error instead of running.
  std::vector<engine::BatchRequest> runnable = requests;
  for (std::size_t i = 0; i < runnable.size(); ++i)
    if (!errors[i].empty()) runnable[i].prompt.clear();
  std::size_t done = 0;
  std::int64_t generated = 0;
  const auto progress = [&](std::size_t, const engine::BatchResult& r) {
    ++done;
    generated += static_cast<std::int64_t>(r.tokens.size());
    err << fmt::format("\r[{}/{}] {} tokens generated", done, runnable.size(), generated) << std::flush;
  };
  const std::vector<engine::BatchResult> results =
      engine.run(runnable, args.ignore_eos ? std::vector<std::int32_t>{} : m.stop_tokens(), progress);
  err << "\n";

  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write '" + tmp + "'");
    for (std::size_t i = 0; i < results.size(); ++i) {
      const engine::BatchResult& r = results[i];
      nlohmann::json o;
      o["index"] = i;
      if (!ids[i].is_null()) o["id"] = ids[i];
      if (!errors[i].empty() || r.finish == engine::Finish::error) {
        o["error"] = errors[i].empty() ? fmt::format("line {}: {}", lines[i], r.error) : errors[i];
        out << json_text(o) << "\n";
        continue;
      }
      std::string text;
      for (std::int32_t t : r.tokens) text += m.tokenizer->token_piece(t);
      o["text"] = text;
      o["prompt_tokens"] = r.prompt_tokens;
      o["completion_tokens"] = r.tokens.size();
      o["finish_reason"] = engine::finish_name(r.finish);
      o["preemptions"] = r.preemptions;
      if (r.has_meter) {
        nlohmann::json meter = r.meter.to_json();
        meter["page_ins"] = r.page_ins;
        meter["page_in_bytes"] = r.page_in_bytes;
        meter["shared_page_ins"] = r.shared_page_ins;
        o["meter"] = meter;
      }
      out << json_text(o) << "\n";
    }
    if (!out.flush()) throw std::runtime_error("cannot write '" + tmp + "'");
  }
  std::filesystem::rename(tmp, args.output);

  const engine::BatchStats& s = engine.stats();
  err << fmt::format(
      "batch: {} requests, {} tokens generated in {:.1f} s ({:.1f} tok/s); {} steps, up to {} sequences at once, "
      "{} preemptions\n",
      results.size(), s.generated, s.seconds, s.generated / std::max(s.seconds, 1e-9), s.steps, s.max_running,
      s.preemptions);
  if (s.decode_tokens > 0)
    err << fmt::format("  decode-only steps: {} tokens in {:.2f} s ({:.1f} tok/s)\n", s.decode_tokens, s.decode_seconds,
                       s.decode_tokens / s.decode_seconds);
  err << fmt::format("  KV pool: {} pages of {} tokens, {} bytes (peak with sequences {}), exact tier {} bytes\n",
                     s.pool_pages, base.page_size, s.pool_bytes, s.peak_bytes, s.backing_bytes);
  return 0;
}

}  // namespace

int run_batch(const BatchArgs& args, std::ostream& err) {
  // The results go to a new file beside the output, renamed to it once every line is written; it
  // is made now, so that an unwritable place fails before the run, and never over an existing file.
  const std::string tmp = args.output + ".partial";
  std::FILE* f = std::fopen(tmp.c_str(), "wx");
  if (f == nullptr)
    throw std::runtime_error(errno == EEXIST ? "'" + tmp + "' exists (another batch writing there?); remove it to go on"
                                             : "cannot write '" + tmp + "'");
  std::fclose(f);
  try {
    return run_batch_to(args, tmp, err);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);  // no half-written file is left behind
    throw;
  }
}

}  // namespace witcert::apps
