// `witcert batch`: JSON lines of requests in, JSON lines of results out in input order, all
// requests run together over one shared KV pool (engine/batch.h).
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "apps/cli/commands.h"
#include "apps/report/run.h"
#include "apps/serve/request.h"
#include "engine/batch.h"
#include "engine/meter_object.h"
#include "engine/model.h"
#include "engine/options.h"
#include "model/sampler.h"

namespace witcert::apps {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// One input line as a request. Keys: prompt (text) or messages ([{role, content}], rendered by
// the model's chat template), max_tokens, temperature, top_p, top_k, seed, and with a certified cache
// the request's policy: tau_k (τ_K of the gate), tau_v, granularity, delta, bound, coverage_tau,
// coverage_tau_v. id is echoed. Anything else is an error naming the key.
engine::BatchRequest parse_request(const nlohmann::json& j, const engine::Model& m, const engine::CacheOptions& base,
                                   const BatchArgs& args) {
  require(j.is_object(), "a request is a JSON object");
  static const std::vector<std::string_view> known = [] {
    std::vector<std::string_view> k = {"id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed"};
    k.insert(k.end(), std::begin(engine::RequestPolicy::kKeys), std::end(engine::RequestPolicy::kKeys));
    return k;
  }();
  for (const auto& [key, value] : j.items())
    require(std::find(known.begin(), known.end(), key) != known.end(), "unknown key '" + key + "'");
  require(j.contains("prompt") != j.contains("messages"), "give either prompt or messages");
  engine::BatchRequest r;
  if (j.contains("prompt")) {
    std::string text;
    engine::read_json(j, "prompt", text);
    r.prompt = m.prompt_tokens(text, false);
  } else {
    r.prompt = m.tokenizer->encode_chat(chat_messages(j.at("messages")), true);
  }
  r.max_tokens = args.max_tokens;
  engine::read_json(j, "max_tokens", r.max_tokens);
  require(r.max_tokens >= 1 && r.max_tokens <= 1000000, "max_tokens must be in [1, 1000000], got " + std::to_string(r.max_tokens));
  engine::read_json(j, "temperature", r.sampler.temperature);
  engine::read_json(j, "top_p", r.sampler.top_p);
  engine::read_json(j, "top_k", r.sampler.top_k);
  engine::read_json(j, "seed", r.sampler.seed);
  model::Sampler{r.sampler};  // a bad temperature, top_p or top_k is this line's error, before the engine takes it
  r.set_policy(engine::RequestPolicy::from_json(j, base, args.cache.coverage_tau, args.cache.tau_v));
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

// A file the run reads, which the results must never replace.
struct RunInput {
  const char* what;  // "the model file (--model)"
  std::string path;
};

// An error of the system call that set `error` (errno, read before anything else may change it).
std::runtime_error os_error(int error, const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(error));
}

// Throws unless the results may be renamed onto `out`: it is absent, or a regular file (never a
// symbolic link, device, directory or FIFO) that is none of `inputs`. An existing input is compared
// by device and inode, which catches any other name or hard link of it; one the run has yet to
// create (a backing file) by its resolved path.
void check_destination(const std::string& out, const std::vector<RunInput>& inputs) {
  require(!out.empty(), "--output is empty");
  struct stat o {};
  if (::lstat(out.c_str(), &o) != 0) {
    const int error = errno;
    if (error != ENOENT) throw os_error(error, "--output '" + out + "'");
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path where = fs::weakly_canonical(out, ec);
    if (ec) return;  // an unreachable place: creating the results' file there says why
    for (const RunInput& in : inputs) {
      const fs::path path = fs::weakly_canonical(in.path, ec);
      if (!ec && path == where)
        throw std::invalid_argument("--output '" + out + "' is " + in.what + "; refusing to write the results there");
    }
    return;
  }
  if (S_ISLNK(o.st_mode))
    throw std::invalid_argument("--output '" + out + "' is a symbolic link; refusing to replace it (name the file itself)");
  if (!S_ISREG(o.st_mode))
    throw std::invalid_argument("--output '" + out +
                                "' is not a regular file (a directory, device or FIFO); refusing to replace it");
  for (const RunInput& in : inputs) {
    struct stat s {};
    if (::stat(in.path.c_str(), &s) == 0 && s.st_dev == o.st_dev && s.st_ino == o.st_ino)
      throw std::invalid_argument("--output '" + out + "' is " + in.what + "; refusing to overwrite it");
  }
}

// The results' temporary file: created new under a unique name (.OUT.XXXXXX) beside the output,
// so that the rename onto it stays within one file system and a file left by a killed run blocks
// no later one; removed unless committed.
class StagedFile {
 public:
  explicit StagedFile(const std::string& out) {
    namespace fs = std::filesystem;
    const fs::path target(out);
    const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
    std::string name = (dir / fmt::format(".{}.XXXXXX", target.filename().string())).string();
    fd_ = ::mkstemp(name.data());
    if (fd_ < 0) {
      const int error = errno;
      throw os_error(error, "cannot create the results' file in '" + dir.string() + "'");
    }
    path_ = std::move(name);
    // mkstemp makes the file private; the results get a new file's usual mode. Setting the umask
    // is the one way to read it, done before any thread starts.
    const mode_t mask = ::umask(0);
    ::umask(mask);
    if (::fchmod(fd_, 0666 & ~mask) != 0) {
      const int error = errno;
      ::close(fd_);
      ::unlink(path_.c_str());
      throw os_error(error, "cannot set the mode of '" + path_ + "'");
    }
  }
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;
  ~StagedFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!path_.empty()) ::unlink(path_.c_str());
  }

  void write(std::string_view text) {
    while (!text.empty()) {
      const ssize_t n = ::write(fd_, text.data(), text.size());
      const int error = n < 0 ? errno : EIO;
      if (n < 0 && error == EINTR) continue;
      if (n <= 0) throw os_error(error, "cannot write '" + path_ + "'");
      text.remove_prefix(static_cast<std::size_t>(n));
    }
  }

  // Puts the results on disk and renames them onto `out`, once `out` passes check_destination again.
  void commit(const std::string& out, const std::vector<RunInput>& inputs) {
    int error = ::fsync(fd_) == 0 ? 0 : errno;
    if (::close(fd_) != 0 && error == 0) error = errno;
    fd_ = -1;
    if (error != 0) throw os_error(error, "cannot write '" + path_ + "'");
    check_destination(out, inputs);
    if (::rename(path_.c_str(), out.c_str()) != 0) {
      error = errno;
      throw os_error(error, "cannot rename '" + path_ + "' to '" + out + "'");
    }
    path_.clear();
  }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace

int run_batch(const BatchArgs& args, std::ostream& err) {
  const std::string model_path = args.model.empty() ? engine::default_model_path() : args.model;
  const engine::CacheOptions base = cache_options(args.cache, args.cache.kv, model_path);
  engine::BatchOptions bo;
  bo.max_seqs = args.max_seqs;
  bo.kv_memory = args.kv_memory.empty() ? 0 : parse_bytes(args.kv_memory);
  bo.validate();
  // The output is checked before anything is computed, and again just before the rename.
  std::vector<RunInput> inputs = {{"the model file (--model)", model_path}, {"the input file (--input)", args.input}};
  if (!base.backing.path.empty()) inputs.push_back({"the backing file (--backing-file)", base.backing.path});
  check_destination(args.output, inputs);
  std::ifstream in(args.input);
  if (!in) throw std::runtime_error("cannot read '" + args.input + "'");
  StagedFile staged(args.output);

  engine::Model m = engine::Model::load(model_path);
  std::vector<engine::BatchRequest> requests;
  std::vector<std::string> errors;
  std::vector<nlohmann::json> ids;
  std::vector<std::size_t> lines;  // the input line of each request
  std::string line;
  for (std::size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are not requests
    nlohmann::json id;
    try {
      const nlohmann::json j = engine::parse_json(line);
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
  std::size_t done = 0;
  std::int64_t generated = 0;
  // On a terminal one line redrawn in place; in a log a line at every tenth of the requests.
  const bool terminal = stderr_is_terminal();
  const auto progress = [&](std::size_t, const engine::BatchResult& r) {
    ++done;
    generated += static_cast<std::int64_t>(r.tokens.size());
    const std::size_t n = requests.size();
    if (!terminal && done != n && done * 10 / n == (done - 1) * 10 / n) return;
    err << fmt::format("{}[{}/{}] {} tokens generated{}", terminal ? "\r" : "", done, n, generated, terminal ? "" : "\n")
        << std::flush;
  };
  const std::vector<engine::BatchResult> results =
      engine.run(requests, args.ignore_eos ? std::vector<std::int32_t>{} : m.stop_tokens(), progress);
  if (terminal) err << "\n";

  std::size_t failed = 0;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const engine::BatchResult& r = results[i];
    nlohmann::json o;
    o["index"] = i;
    if (!ids[i].is_null()) o["id"] = ids[i];
    if (!errors[i].empty() || r.finish == engine::Finish::error) {
      o["error"] = errors[i].empty() ? fmt::format("line {}: {}", lines[i], r.error) : errors[i];
      staged.write(json_text(o) + "\n");
      ++failed;
      continue;
    }
    std::string text;
    for (std::int32_t t : r.tokens) text += m.tokenizer->token_piece(t);
    o["text"] = text;
    o["prompt_tokens"] = r.prompt_tokens;
    o["completion_tokens"] = r.tokens.size();
    o["finish_reason"] = engine::finish_name(r.finish);
    o["preemptions"] = r.preemptions;
    if (r.has_meter) o["meter"] = engine::meter_object(requests[i].cache, r);  // serve's witcert object
    staged.write(json_text(o) + "\n");
  }
  staged.commit(args.output, inputs);

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
  if (failed > 0) err << fmt::format("batch: {} of {} requests failed; their lines in the output say why\n", failed, results.size());
  return failed > 0 ? 1 : 0;
}

}  // namespace witcert::apps
