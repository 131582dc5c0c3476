#include "apps/serve/server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <filesystem>
#include <future>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "apps/serve/dashboard.h"
#include "base/thread_pool.h"
#include "engine/meter_object.h"

namespace witcert::apps {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kRecentVerdicts = 50;  // the dashboard's banner reads the last this many requests

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_text(e), "application/json");
}

// The number of leading bytes of s that form whole UTF-8 characters (a token may end inside one).
std::size_t whole_utf8(std::string_view s) {
  std::size_t end = s.size(), i = s.size();
  for (int back = 0; back < 4 && i > 0; ++back) {
    const auto c = static_cast<unsigned char>(s[--i]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte
    const int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
    if (i + static_cast<std::size_t>(len) > s.size()) end = i;
    break;
  }
  return end;
}

std::string unix_id(const char* prefix, std::uint64_t n) { return fmt::format("{}-{}", prefix, n); }

// The connections' limits, with the body's bound on the wire following --max-body (and room for
// the chunked framing around it).
ConnectionLimits connection_limits(const ServeOptions& o) {
  ConnectionLimits l = o.connections;
  l.max_body_bytes = o.max_body + (64 << 10);
  return l;
}

// An ambiguous or unsupported framing of the request's body, which a proxy in front of the server
// might read otherwise than the server does: two lengths, a length beside Transfer-Encoding, a
// transfer coding other than chunked, a length that is not a number, an unknown content coding.
std::optional<ApiError> framing_error(const httplib::Request& req) {
  const auto bad = [](const std::string& why) { return ApiError(400, why, "", "bad_framing"); };
  const std::size_t lengths = req.get_header_value_count("Content-Length");
  if (lengths > 1) return bad("more than one Content-Length header");
  const std::size_t codings = req.get_header_value_count("Transfer-Encoding");
  if (codings > 0 && lengths > 0) return bad("Content-Length beside Transfer-Encoding");
  if (codings > 1 || (codings == 1 && req.get_header_value("Transfer-Encoding") != "chunked"))
    return bad("the only transfer coding taken is a single 'chunked'");
  if (lengths == 1) {
    const std::string n = req.get_header_value("Content-Length");
    if (n.empty() || n.size() > 18 || n.find_first_not_of("0123456789") != std::string::npos)
      return bad("Content-Length is not a number");
  }
  if (req.get_header_value_count("Content-Encoding") > 1) return bad("more than one Content-Encoding header");
  const std::string coding = req.get_header_value("Content-Encoding");
  if (!coding.empty() && coding != "identity" && coding != "gzip" && coding != "deflate" && coding != "br")
    return ApiError(415, "Content-Encoding '" + coding + "' is not taken (gzip, deflate, br)", "",
                    "unsupported_media_type");
  return std::nullopt;
}

// The Authorization header against the expected one in time that does not depend on where they differ.
bool same_key(const std::string& given, const std::string& expected) {
  unsigned diff = given.size() == expected.size() ? 0u : 1u;
  for (std::size_t i = 0; i < expected.size(); ++i)
    diff |= static_cast<unsigned char>(expected[i]) ^ static_cast<unsigned char>(i < given.size() ? given[i] : 0);
  return diff == 0;
}

// The request's body, decompressed as it arrives and refused past `limit` bytes (a small gzip body
// may inflate a thousandfold); a body that cannot be read (a deadline, a broken encoding) is a 400.
std::string read_body(const httplib::ContentReader& reader, httplib::Response& res, std::size_t limit) {
  std::string body;
  bool too_large = false;
  const bool ok = reader([&](const char* data, std::size_t n) {
    if (n > limit - body.size()) {
      too_large = true;
      return false;
    }
    body.append(data, n);
    return true;
  });
  if (too_large || res.status == 413)
    throw ApiError(413, fmt::format("the request body is larger than {} bytes (decompressed)", limit), "",
                   "body_too_large");
  if (!ok) throw ApiError(400, "the request body could not be read (cut short, too slow or badly encoded)", "",
                          "bad_body");
  return body;
}

}  // namespace

// One request between its handler and the engine thread. The engine thread appends pieces and
// sets the result under mu; the handler reads them; cancel asks the engine to drop the sequence.
struct Server::Job : RequestSpec {
  struct Piece {
    std::int32_t token = 0;
    float logprob = 0.0f;
    std::vector<std::pair<std::int32_t, float>> top;  // the top_logprobs alternatives
  };
  std::uint64_t id = 0;
  std::string response_id;  // the id its response carries ("cmpl-N", "chatcmpl-N")
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Piece> pieces;
  json live_meter;          // a stream's meter so far (compact_meter), sent once with the next chunk
  bool live_meter_new = false;
  bool done = false;
  engine::BatchResult result;
  std::atomic<bool> cancel{false};
  Clock::time_point arrived = Clock::now(), first_token, finished;
  bool has_first = false;
};

namespace {

// Turns a job's tokens into its text: stop strings end it (the text stops before the match),
// and a stream sends only what can no longer change (whole UTF-8 characters, nothing that could
// begin a stop string).
class Reply {
 public:
  Reply(const engine::Model& m, const Server::Job& job) : m_(m), job_(job) {}
  // Takes one token; false once a stop string has matched (later tokens are dropped).
  bool add(const Server::Job::Piece& p) {
    if (stopped_) return false;
    const std::size_t before = text_.size();
    text_ += m_.tokenizer->token_piece(p.token);
    tokens_ += 1;
    if (job_.logprobs) pieces_.push_back(p);
    for (const std::string& s : job_.stop) {
      const std::size_t from = before >= s.size() ? before - s.size() + 1 : 0;
      const std::size_t at = text_.find(s, from);
      if (at != std::string::npos) {
        text_.resize(at);
        stopped_ = true;
      }
    }
    return !stopped_;
  }
  bool stopped() const { return stopped_; }
  bool new_logprobs() const { return pieces_.size() > lp_sent_; }  // tokens whose logprobs are not sent
  std::int64_t tokens() const { return tokens_; }
  // The text not sent yet that can be sent now (all of it when `final`).
  std::string take(bool final) {
    std::size_t end = text_.size();
    if (!final && !stopped_) {
      for (const std::string& s : job_.stop)
        for (std::size_t k = std::min(s.size() - 1, end - sent_); k > 0; --k)
          if (text_.compare(end - k, k, s, 0, k) == 0) {
            end -= k;
            break;
          }
    }
    if (!final) end = whole_utf8(std::string_view(text_).substr(0, end));
    std::string out = text_.substr(sent_, end - std::min(end, sent_));
    sent_ = std::max(sent_, end);
    return out;
  }
  // The logprobs of the tokens taken since the last call, as the endpoint writes them.
  json logprobs(bool chat) {
    std::vector<Server::Job::Piece> ps(pieces_.begin() + static_cast<std::ptrdiff_t>(lp_sent_), pieces_.end());
    lp_sent_ = pieces_.size();
    // Token pieces as they are: every response is written with invalid UTF-8 replaced.
    const auto text_of = [&](std::int32_t t) { return m_.tokenizer->token_piece(t); };
    if (chat) {
      json content = json::array();
      for (const auto& p : ps) {
        json top = json::array();
        for (const auto& [t, lp] : p.top) top.push_back({{"token", text_of(t)}, {"logprob", lp}});
        content.push_back({{"token", text_of(p.token)}, {"logprob", p.logprob}, {"top_logprobs", top}});
      }
      return {{"content", content}};
    }
    json tokens = json::array(), lps = json::array(), tops = json::array();
    for (const auto& p : ps) {
      tokens.push_back(text_of(p.token));
      lps.push_back(p.logprob);
      json top = json::object();
      for (const auto& [t, lp] : p.top) top[text_of(t)] = lp;
      tops.push_back(top);
    }
    return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}};
  }

 private:
  const engine::Model& m_;
  const Server::Job& job_;
  std::string text_;
  std::size_t sent_ = 0, lp_sent_ = 0;
  std::int64_t tokens_ = 0;
  bool stopped_ = false;
  std::vector<Server::Job::Piece> pieces_;
};

// The error of a request the engine failed: 500 when the engine or the activations failed, 400
// when the engine refused the request itself.
ApiError result_error(const engine::BatchResult& r) {
  const bool internal = r.error.rfind("internal error", 0) == 0 || r.error.rfind("non-finite", 0) == 0;
  return ApiError(internal ? 500 : 400, r.error, "", internal ? "internal_error" : "invalid_value");
}

// Moves the job's arrived tokens into its reply (job.mu held); true when a stop string matched
// (the caller cancels the sequence).
bool take_pieces(Server::Job& job, Reply& reply) {
  bool stopped = false;
  while (!job.pieces.empty()) {
    stopped = !reply.add(job.pieces.front()) || stopped;
    job.pieces.pop_front();
  }
  return stopped;
}

// The request's meter so far, as a stream's chunks carry it: the counts behind the verdict.
json compact_meter(const gate::TelemetrySummary& m) {
  return {{"cells", m.cells},
          {"coverage", m.cells > 0 ? json(m.coverage.joint) : json(nullptr)},
          {"repaired", m.repaired},
          {"page_ins", m.page_ins},
          {"verdict", gate::verdict_name(m.verdict())}};
}

// The request's meter, as every response carries it beside usage (r: its result, or its
// counters so far while it runs), with the per-(layer, head) grid where the request asked.
json witcert_object(const Server::Job& job, const engine::BatchResult& r, const engine::Model& m) {
  json w = engine::meter_object(job.req.cache, r);
  if (r.has_meter && job.detail) {
    const model::LlamaConfig& cfg = m.model->config();
    w["mean_meter_by_layer_head"] = layer_head_grid(r.heatmap, cfg.layers, cfg.heads);
  }
  return w;
}

}  // namespace

Server::Server(ServeOptions opts)
    : opts_(std::move(opts)), http_(std::make_unique<GuardedServer>(connection_limits(opts_))) {
  if (opts_.model_name.empty()) opts_.model_name = std::filesystem::path(opts_.model_path).stem().string();
  defaults_ = {opts_.model_name, opts_.max_tokens, opts_.cache, opts_.coverage_tau, opts_.coverage_tau_v};
  metrics_.counter("witcert_prompt_tokens_total", "Prompt tokens of finished requests.");
  metrics_.counter("witcert_generation_tokens_total", "Tokens generated for finished requests.");
  metrics_.counter("witcert_requests_total", "Finished requests by finish reason (stop, length, cancelled, error).");
  metrics_.gauge("witcert_requests_running", "Sequences in the running batch.");
  metrics_.gauge("witcert_requests_waiting", "Requests queued for admission.");
  metrics_.counter("witcert_meter_cells_total", "Metered (layer, query head, decode step) cells by side and scheme.");
  metrics_.counter("witcert_meter_certified_cells_total",
                   "Cells whose served meter met the request's tau, by side (K: tau_k, V: tau_v) and scheme.");
  metrics_.histogram("witcert_meter_raw_score", "Raw e-form scores of metered cells before repair.",
                     std::vector<double>(std::begin(gate::kRawScoreBounds), std::end(gate::kRawScoreBounds)));
  metrics_.counter("witcert_meter_overflow_cells_total", "Cells whose raw score overflowed (no guarantee).");
  metrics_.counter("witcert_requests_rejected_total",
                   "Requests answered with an error status before or instead of generating, by status.");
  metrics_.counter("witcert_preemptions_total", "Times finished requests were preempted and recomputed.");
  metrics_.gauge("witcert_build_info", "1, labelled with the version, the served model and the pool's K and V formats.");
  metrics_.counter("witcert_requests_verdict_total",
                   "Finished requests by verdict (certified, repaired, at-risk, unmetered), errors excluded.");
  metrics_.counter("witcert_page_ins_total", "Pages promoted to exact by the gate's repairs.");
  metrics_.counter("witcert_page_in_bytes_total", "Bytes read from the exact tier by the gate's repairs.");
  metrics_.gauge("witcert_kv_pool_used_bytes", "Measured bytes of the KV pool in use by live sequences.");
  metrics_.gauge("witcert_kv_pool_capacity_bytes", "Measured bytes of the whole KV pool.");
  metrics_.gauge("witcert_kv_pool_usage_ratio", "Used pages over the pool's pages.");
  metrics_.gauge("witcert_kv_pool_cached_prefixes",
                 "Finished sequences whose prompt pages stay in the pool for prefix sharing (counted as used until "
                 "a new sequence needs the room).");
  const std::vector<double> seconds = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
  metrics_.histogram("witcert_time_to_first_token_seconds", "Time from arrival to the first generated token.", seconds);
  metrics_.histogram("witcert_time_per_output_token_seconds", "Mean time between a request's generated tokens.", seconds);
  metrics_.histogram("witcert_request_duration_seconds", "Time from arrival to the last byte of the response.", seconds);
  metrics_.set("witcert_requests_running", 0);
  metrics_.set("witcert_requests_waiting", 0);
  metrics_.set("witcert_build_info", 1,
               {{"version", WITCERT_VERSION_STRING},
                {"model", opts_.model_name},
                {"kv", opts_.cache.format_name(formats::KvSide::key)},
                {"kv_v", opts_.cache.format_name(formats::KvSide::value)}});
}

Server::~Server() { shutdown(std::chrono::milliseconds(0)); }

int Server::start() {
  // The body as sent; the routes also bound it decompressed (read_body).
  http_->set_payload_max_length(opts_.max_body);
  route();
  port_ = http_->bind(opts_.host, opts_.port);
  if (port_ < 0) throw std::runtime_error(fmt::format("cannot listen on {}:{}", opts_.host, opts_.port));
  started_ = std::chrono::system_clock::now();
  listener_ = std::thread([this] {
    http_->listen_after_bind();
    listener_done_ = true;
  });
  // httplib's stop() does nothing before its accept loop runs: wait for it, so that a server
  // stopped at once (a failed start) still ends.
  while (!http_->is_running() && !listener_done_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  engine_ = std::thread([this] { engine_loop(); });
  return port_;
}

void Server::fail_start(const std::string& error) {
  {
    std::lock_guard lock(mu_);
    load_failed_ = true;
    load_error_ = error;
  }
  cv_.notify_all();
}

bool Server::wait_ready() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return loaded_ || load_failed_; });
  return loaded_;
}

std::string Server::load_error() const {
  std::lock_guard lock(mu_);
  return load_error_;
}

bool Server::enqueue(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard lock(mu_);
    if (stopping_ || draining_) return false;
    if (pending_ - opts_.batch.max_seqs >= opts_.max_waiting) return false;  // beyond the batch, queued
    inbox_.push_back(job);
    pending_ += 1;
  }
  cv_.notify_all();
  return true;
}

void Server::complete(Job& job, const engine::BatchResult& result) {
  {
    std::lock_guard lock(job.mu);
    job.result = result;
    job.done = true;
    job.finished = Clock::now();
  }
  {
    std::lock_guard lock(mu_);
    pending_ -= 1;  // before the handler hears of it: a finished request is never counted as queued
  }
  job.cv.notify_all();
}

void Server::cancel(const std::shared_ptr<Job>& job) {
  job->cancel = true;
  cv_.notify_all();
}

void Server::publish_load(const engine::BatchLoad& l) {
  metrics_.set("witcert_requests_running", static_cast<double>(l.running));
  std::int64_t queued = 0;
  {
    std::lock_guard lock(mu_);
    queued = static_cast<std::int64_t>(inbox_.size());
  }
  metrics_.set("witcert_requests_waiting", static_cast<double>(l.waiting + queued));
  metrics_.set("witcert_kv_pool_used_bytes",
               l.pool_pages > 0 ? static_cast<double>(l.pool_bytes) * (l.pool_pages - l.free_pages) / l.pool_pages : 0.0);
  metrics_.set("witcert_kv_pool_capacity_bytes", static_cast<double>(l.pool_bytes));
  metrics_.set("witcert_kv_pool_cached_prefixes", static_cast<double>(l.cached_prefixes));
  metrics_.set("witcert_kv_pool_usage_ratio",
               l.pool_pages > 0 ? static_cast<double>(l.pool_pages - l.free_pages) / l.pool_pages : 0.0);
}

void Server::engine_loop() {
  // The model and the pool, before /health says ready: a missing model or a budget that holds no
  // sequence fails the start with its reason.
  try {
    engine::Model m = engine::Model::load(opts_.model_path);
    std::lock_guard lock(mu_);
    model_ = std::move(m);
    stop_tokens_ = model_.stop_tokens();
  } catch (const std::exception& e) {
    fail_start(e.what());
    return;
  }
  ThreadPool threads(opts_.threads);
  const model::LlamaConfig& cfg = model_.model->config();
  const auto make_engine = [&] {
    auto e = std::make_unique<engine::BatchEngine>(*model_.model, threads, opts_.cache, opts_.batch);
    e->open(cfg.context, opts_.cache.certified);  // the tier that any request's gate may read
    return e;
  };
  std::unique_ptr<engine::BatchEngine> eng;
  try {
    eng = make_engine();
  } catch (const std::exception& e) {
    fail_start(e.what());
    return;
  }
  {
    std::lock_guard lock(state_mu_);
    heat_layers_ = cfg.layers;
    heat_heads_ = cfg.heads;
    heat_.assign(static_cast<std::size_t>(cfg.layers) * cfg.heads, NAN);
  }
  publish_load(eng->load());
  {
    std::lock_guard lock(mu_);
    loaded_ = true;
  }
  cv_.notify_all();
  std::vector<std::pair<std::uint64_t, std::shared_ptr<Job>>> live;
  for (;;) {
    std::vector<std::shared_ptr<Job>> fresh;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !inbox_.empty() || !queries_.empty() || !eng->idle(); });
      if (stopping_ && inbox_.empty() && eng->idle()) break;
      fresh.swap(inbox_);
    }
    for (const std::shared_ptr<Job>& job : fresh) {
      Job* j = job.get();
      engine::RequestEvents ev;
      ev.on_token = [j](std::int32_t t, std::span<const float> logits) {
        Job::Piece p;
        p.token = t;
        if (j->logprobs) {
          double mx = -INFINITY;
          for (float v : logits) mx = std::max<double>(mx, v);
          double sum = 0.0;
          for (float v : logits) sum += std::exp(v - mx);
          const double lse = mx + std::log(sum);
          p.logprob = static_cast<float>(logits[static_cast<std::size_t>(t)] - lse);
          // The top_logprobs (≤ 20) largest logits in one pass, best first, without a vocabulary-sized buffer.
          const std::size_t k = std::min<std::size_t>(static_cast<std::size_t>(std::max(j->top_logprobs, 0)), logits.size());
          for (std::size_t i = 0; i < logits.size() && k > 0; ++i) {
            if (p.top.size() == k && logits[i] <= logits[static_cast<std::size_t>(p.top.back().first)]) continue;
            if (p.top.size() == k) p.top.pop_back();
            auto at = p.top.begin();
            while (at != p.top.end() && logits[static_cast<std::size_t>(at->first)] >= logits[i]) ++at;
            p.top.insert(at, {static_cast<std::int32_t>(i), 0.0f});
          }
          for (auto& [id, lp] : p.top) lp = static_cast<float>(logits[static_cast<std::size_t>(id)] - lse);
        }
        {
          std::lock_guard lock(j->mu);
          if (!j->has_first) j->first_token = Clock::now(), j->has_first = true;
          j->pieces.push_back(std::move(p));
        }
        j->cv.notify_all();
      };
      ev.on_done = [this, j](const engine::BatchResult& r) { complete(*j, r); };
      if (j->stream && j->meter_every > 0) {
        ev.meter_every = j->meter_every;
        ev.on_meter = [j](const gate::TelemetrySummary& m) {
          json c = compact_meter(m);
          std::lock_guard lock(j->mu);
          j->live_meter = std::move(c);
          j->live_meter_new = true;
        };
      }
      const std::uint64_t id = eng->submit(j->req, std::move(ev), stop_tokens_);
      std::lock_guard lock(j->mu);
      if (!j->done) live.push_back({id, job});
    }
    bool stopping = false;
    {
      std::lock_guard lock(mu_);
      stopping = stopping_;
    }
    for (const auto& [id, job] : live)
      if (job->cancel || stopping) eng->cancel(id);  // past the drain deadline every request ends
    try {
      eng->step();
    } catch (const std::exception& e) {
      // An internal failure ends the requests of this batch alone; the server goes on with a new pool.
      engine::BatchResult failed;
      failed.finish = engine::Finish::error;
      failed.error = std::string("internal error: ") + e.what();
      for (const auto& [id, job] : live) {
        bool done = false;
        {
          std::lock_guard lock(job->mu);
          done = job->done;
        }
        if (!done) complete(*job, failed);
      }
      live.clear();
      eng.reset();
      eng = make_engine();
    }
    live.erase(std::remove_if(live.begin(), live.end(),
                              [](const auto& e) {
                                std::lock_guard lock(e.second->mu);
                                return e.second->done;
                              }),
               live.end());
    publish_load(eng->load());
    answer_queries(*eng, live);
  }
  {
    std::lock_guard lock(mu_);
    engine_done_ = true;  // no query waits on this thread from now on
  }
  answer_queries(*eng, live);
}

void Server::answer_queries(const engine::BatchEngine& eng,
                            const std::vector<std::pair<std::uint64_t, std::shared_ptr<Job>>>& live) {
  std::vector<std::promise<json>> asked;
  {
    std::lock_guard lock(mu_);
    asked.swap(queries_);
  }
  if (asked.empty()) return;
  json list = json::array();
  for (const auto& [id, job] : live) {
    const std::optional<engine::RequestSnapshot> snap = eng.snapshot(id);
    if (!snap) continue;
    const engine::BatchResult& r = snap->so_far;
    list.push_back({{"id", job->response_id},
                    {"state", snap->running ? "running" : "waiting"},
                    {"prompt_tokens", r.prompt_tokens},
                    {"completion_tokens", r.tokens.size()},
                    {"preemptions", r.preemptions},
                    {"witcert", witcert_object(*job, r, model_)}});
  }
  for (std::promise<json>& p : asked) p.set_value({{"object", "list"}, {"data", list}});
}

json Server::live_requests() {
  std::promise<json> answer;
  std::future<json> got = answer.get_future();
  {
    std::lock_guard lock(mu_);
    if (!loaded_ || engine_done_) throw ApiError(503, "the engine is not running", "", "not_ready");
    queries_.push_back(std::move(answer));
  }
  cv_.notify_all();
  // The engine answers between two steps.
  if (got.wait_for(std::chrono::seconds(30)) != std::future_status::ready)
    throw ApiError(503, "the engine did not answer in 30 s", "", "busy");
  return got.get();
}

void Server::record(const Job& job, const std::string& finish, std::int64_t completion_tokens) {
  const engine::BatchResult& r = job.result;
  metrics_.add("witcert_requests_total", 1, {{"finish_reason", finish}});
  metrics_.add("witcert_preemptions_total", static_cast<double>(r.preemptions));
  metrics_.add("witcert_prompt_tokens_total", static_cast<double>(job.req.prompt.size()));
  metrics_.add("witcert_generation_tokens_total", static_cast<double>(completion_tokens));
  const double now = std::chrono::duration<double>(Clock::now() - job.arrived).count();
  metrics_.observe("witcert_request_duration_seconds", now);
  if (job.has_first) {
    metrics_.observe("witcert_time_to_first_token_seconds",
                     std::chrono::duration<double>(job.first_token - job.arrived).count());
    if (completion_tokens > 1)
      metrics_.observe("witcert_time_per_output_token_seconds",
                       std::chrono::duration<double>(job.finished - job.first_token).count() /
                           static_cast<double>(completion_tokens - 1));
  }
  if (finish != "error") {
    const gate::Verdict verdict = r.has_meter ? r.meter.verdict() : gate::Verdict::unmetered;
    metrics_.add("witcert_requests_verdict_total", 1, {{"verdict", gate::verdict_name(verdict)}});
    std::lock_guard lock(state_mu_);
    verdicts_.push_back(gate::verdict_name(verdict));
    while (verdicts_.size() > kRecentVerdicts) verdicts_.pop_front();
    if (verdict == gate::Verdict::at_risk) at_risk_reason_ = r.meter.reason();
  }
  if (!r.has_meter) {
    sample();
    return;
  }
  {
    // The heatmap of recent requests: each finished request moves every cell a fifth of the way.
    std::lock_guard lock(state_mu_);
    for (std::size_t i = 0; i < heat_.size(); ++i)
      if (!std::isnan(r.heatmap[i])) heat_[i] = std::isnan(heat_[i]) ? r.heatmap[i] : 0.8 * heat_[i] + 0.2 * r.heatmap[i];
  }
  const engine::CacheOptions& c = job.req.cache;
  const double cells = static_cast<double>(r.meter.cells);
  const Metrics::Labels k = {{"side", "K"}, {"scheme", c.format_name(formats::KvSide::key)}},
                        v = {{"side", "V"}, {"scheme", c.format_name(formats::KvSide::value)}};
  metrics_.add("witcert_meter_cells_total", cells, k);
  metrics_.add("witcert_meter_cells_total", cells, v);
  metrics_.add("witcert_meter_certified_cells_total", std::round(r.meter.coverage.k * cells), k);
  metrics_.add("witcert_meter_certified_cells_total", std::round(r.meter.coverage.v * cells), v);
  metrics_.observe_counts("witcert_meter_raw_score", r.raw_histogram.counts, r.raw_histogram.finite_sum,
                          {{"scheme", c.format_name(formats::KvSide::key)}});
  metrics_.add("witcert_meter_overflow_cells_total", static_cast<double>(r.meter.overflow));
  metrics_.add("witcert_page_ins_total", static_cast<double>(r.page_ins));
  metrics_.add("witcert_page_in_bytes_total", static_cast<double>(r.page_in_bytes));
  sample();
}

void Server::shutdown(std::chrono::milliseconds deadline) {
  if (!http_) return;
  draining_ = true;
  const auto until = Clock::now() + deadline;
  {
    std::unique_lock lock(mu_);
    while (pending_ > 0 && Clock::now() < until) {
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      lock.lock();
    }
    stopping_ = true;
  }
  cv_.notify_all();
  // Past the deadline the engine cancels what still runs and ends; each open stream then sends its
  // last chunk and [DONE] before the listener stops (httplib cuts streams short once it stops).
  if (engine_.joinable()) engine_.join();
  const auto flushed = Clock::now() + std::chrono::seconds(5);
  while (open_streams_ > 0 && Clock::now() < flushed) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  http_->stop();
  if (listener_.joinable()) listener_.join();
  http_.reset();
}

void Server::route() {
  httplib::Server& s = *http_;
  // Every answer with an error status, counted once it is written (a stream that fails after its
  // 200 is counted by its finish reason instead).
  s.set_logger([this](const httplib::Request&, const httplib::Response& res) {
    if (res.status >= 400) metrics_.add("witcert_requests_rejected_total", 1, {{"status", std::to_string(res.status)}});
  });
  // Framing before anything else (a request whose length is ambiguous is refused, not guessed),
  // then authentication and readiness before any /v1 route; /health, /metrics and the dashboard
  // stay open.
  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (const std::optional<ApiError> bad = framing_error(req)) {
      send_error(res, *bad);
      return httplib::Server::HandlerResponse::Handled;
    }
    // A browser's CORS preflight carries no credentials: it is answered for every route.
    if (req.method == "OPTIONS") {
      res.status = 204;
      res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
      res.set_header("Access-Control-Max-Age", "600");
      return httplib::Server::HandlerResponse::Handled;
    }
    const bool model_route = req.path.rfind("/v1/", 0) == 0 || req.path == "/tokenize" || req.path == "/detokenize";
    if (!model_route) return httplib::Server::HandlerResponse::Unhandled;
    if (!opts_.api_key.empty() && !same_key(req.get_header_value("Authorization"), "Bearer " + opts_.api_key)) {
      send_error(res, ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", "", "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    }
    std::lock_guard lock(mu_);
    if (!loaded_) {
      send_error(res, ApiError(503, load_failed_ ? "the model failed to load: " + load_error_ : "the model is loading",
                               "", "model_not_ready"));
      res.set_header("Retry-After", "1");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, ApiError(500, "internal error: " + what, "", "internal_error"));
  });
  s.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 413) send_error(res, ApiError(413, "the request body is too large", "", "body_too_large"));
    else if (res.status == 404) send_error(res, ApiError(404, "no such endpoint", "", "not_found"));
  });

  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard lock(mu_);
    if (!loaded_) {
      res.status = 503;
      res.set_content(json_text({{"status", load_failed_ ? "failed" : "loading"}, {"error", load_error_}}),
                      "application/json");
      return;
    }
    res.set_content(json_text({{"status", "ok"}, {"model", opts_.model_name}}), "application/json");
  });
  s.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(dashboard_html(), "text/html; charset=utf-8");
  });
  s.Get("/state", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(json_text(state()), "application/json");
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.exposition(), "text/plain; version=0.0.4; charset=utf-8");
  });
  const auto model_object = [this] {
    const auto created = std::chrono::duration_cast<std::chrono::seconds>(started_.time_since_epoch()).count();
    return json{{"id", opts_.model_name}, {"object", "model"}, {"created", created}, {"owned_by", "witcert"}};
  };
  s.Get("/v1/models", [model_object](const httplib::Request&, httplib::Response& res) {
    res.set_content(json_text({{"object", "list"}, {"data", json::array({model_object()})}}), "application/json");
  });
  s.Get(R"(/v1/models/(.+))", [this, model_object](const httplib::Request& req, httplib::Response& res) {
    if (req.matches[1] != opts_.model_name)
      return send_error(res, ApiError(404, not_served(req.matches[1].str(), opts_.model_name), "model", "model_not_found"));
    res.set_content(json_text(model_object()), "application/json");
  });
  // llama-server's token endpoints: the model's own ids for a text, and the text of ids.
  s.Post("/tokenize", [this](const httplib::Request&, httplib::Response& res, const httplib::ContentReader& reader) {
    try {
      const TokenizeSpec t = parse_tokenize(read_body(reader, res, opts_.max_body));
      const model::Tokenizer& tok = *model_.tokenizer;
      std::vector<std::int32_t> ids = tok.encode(t.content, t.parse_special);
      if (t.add_special) ids = tok.with_bos(std::move(ids));
      json tokens = json::array();
      for (const std::int32_t id : ids)
        tokens.push_back(t.with_pieces ? json{{"id", id}, {"piece", tok.token_piece(id)}} : json(id));
      res.set_content(json_text({{"tokens", tokens}}), "application/json");
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  });
  s.Post("/detokenize", [this](const httplib::Request&, httplib::Response& res, const httplib::ContentReader& reader) {
    try {
      const std::vector<std::int64_t> ids = parse_detokenize(read_body(reader, res, opts_.max_body));
      const model::Tokenizer& tok = *model_.tokenizer;
      for (const std::int64_t id : ids)
        if (id >= tok.vocab_size())
          throw ApiError(400, fmt::format("token id {} is outside the vocabulary of {}", id, tok.vocab_size()), "tokens");
      const std::vector<std::int32_t> checked(ids.begin(), ids.end());
      res.set_content(json_text({{"content", tok.decode(checked)}}), "application/json");
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  });
  // The requests in the engine now, each with its meter so far (answered between two steps).
  s.Get("/v1/witcert/requests", [this](const httplib::Request&, httplib::Response& res) {
    try {
      res.set_content(json_text(live_requests()), "application/json");
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  });
  const auto completion = [this](bool chat) {
    return [this, chat](const httplib::Request&, httplib::Response& res, const httplib::ContentReader& reader) {
      try {
        serve_completion(read_body(reader, res, opts_.max_body), res, chat);
      } catch (const ApiError& e) {
        send_error(res, e);
      }
    };
  };
  s.Post("/v1/completions", completion(false));
  s.Post("/v1/chat/completions", completion(true));
}

std::shared_ptr<Server::Job> Server::parse(const std::string& text, bool chat) {
  auto job = std::make_shared<Job>();
  static_cast<RequestSpec&>(*job) = parse_request(text, chat, defaults_);
  job->id = ++next_id_;
  job->response_id = unix_id(chat ? "chatcmpl" : "cmpl", job->id);
  engine::BatchRequest& r = job->req;
  r.prompt = chat ? model_.chat_tokens(job->messages)
             : job->prompt_is_ids ? job->prompt_ids
                                  : model_.prompt_tokens(job->prompt, false);
  const int vocab = model_.model->config().vocab;
  for (const std::int32_t id : r.prompt)
    if (id >= vocab)
      throw ApiError(400, fmt::format("the prompt's token id {} is outside the vocabulary of {}", id, vocab), "prompt");
  if (r.prompt.empty()) throw ApiError(400, "the prompt is empty", chat ? "messages" : "prompt", "invalid_value");
  const std::int64_t context = model_.model->config().context;
  if (static_cast<std::int64_t>(r.prompt.size()) >= context)
    throw ApiError(400,
                   fmt::format("the prompt has {} tokens; the model's context is {} (the prompt and at least one new "
                               "token must fit)",
                               r.prompt.size(), context),
                   chat ? "messages" : "prompt", "context_length_exceeded");
  // The prompt and its new tokens fit the context: a budget beyond it is refused when the body
  // asked for it, and the server's default is cut to what fits.
  const auto room = static_cast<int>(context - static_cast<std::int64_t>(r.prompt.size()));
  if (job->max_tokens_given && r.max_tokens > room)
    throw ApiError(400,
                   fmt::format("the prompt has {} tokens and max_tokens is {}; the model's context is {}",
                               r.prompt.size(), r.max_tokens, context),
                   "max_tokens", "context_length_exceeded");
  r.max_tokens = std::min(r.max_tokens, room);
  return job;
}

void Server::serve_completion(const std::string& body, httplib::Response& res, bool chat) {
  std::shared_ptr<Job> job = parse(body, chat);
  if (!enqueue(job)) {
    res.set_header("Retry-After", "1");
    throw ApiError(503, draining_ ? "the server is shutting down" : "the queue is full; retry later", "",
                   draining_ ? "shutting_down" : "queue_full");
  }
  const auto created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string& id = job->response_id;
  const char* object = chat ? "chat.completion" : "text_completion";
  const auto finish_reason = [](const Reply& reply, const engine::BatchResult& r) -> std::string {
    if (reply.stopped()) return "stop";
    return engine::finish_name(r.finish);
  };
  const auto usage = [](const Job& j, const Reply& reply) {
    const auto p = static_cast<std::int64_t>(j.req.prompt.size());
    return json{{"prompt_tokens", p}, {"completion_tokens", reply.tokens()}, {"total_tokens", p + reply.tokens()}};
  };

  if (!job->stream) {
    Reply reply(model_, *job);
    {
      std::unique_lock lock(job->mu);
      // A client that goes away cancels its request: it is looked for between the tokens, and at
      // least every 100 ms while none come (a long prefill, a wait for admission).
      for (;;) {
        job->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return job->done || !job->pieces.empty(); });
        if (take_pieces(*job, reply)) cancel(job);
        if (job->done) break;
        if (!job->cancel && GuardedServer::client_gone()) cancel(job);
      }
    }
    const engine::BatchResult& r = job->result;
    if (r.finish == engine::Finish::error) {
      record(*job, "error", 0);
      throw result_error(r);
    }
    const std::string finish = finish_reason(reply, r);
    json choice = {{"index", 0}, {"finish_reason", finish}};
    const std::string text = reply.take(true);
    if (chat) choice["message"] = {{"role", "assistant"}, {"content", text}};
    else choice["text"] = text;
    choice["logprobs"] = job->logprobs ? reply.logprobs(chat) : json(nullptr);
    json out = {{"id", id},           {"object", object},        {"created", created},
                {"model", opts_.model_name}, {"choices", json::array({choice})}, {"usage", usage(*job, reply)},
                {"witcert", witcert_object(*job, job->result, model_)}};
    res.set_content(json_text(out), "application/json");
    record(*job, finish, reply.tokens());
    return;
  }

  // Server-sent events: a chunk per batch of tokens as they come, the last with the finish reason,
  // then usage and the meter, then [DONE]. A client that goes away cancels its sequence.
  auto reply = std::make_shared<Reply>(model_, *job);
  auto state = std::make_shared<int>(0);  // 0: nothing sent, 1: role sent (chat), 2: finished
  res.set_header("Cache-Control", "no-cache");
  open_streams_ += 1;
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job, reply, state, id, object = std::string(chat ? "chat.completion.chunk" : "text_completion"), created,
       chat, finish_reason, usage](std::size_t, httplib::DataSink& sink) {
        const auto send = [&](const json& j) {
          const std::string line = "data: " + json_text(j) + "\n\n";
          return sink.write(line.data(), line.size());
        };
        const auto chunk = [&](const json& choice) {
          return json{{"id", id}, {"object", object}, {"created", created}, {"model", opts_.model_name},
                      {"choices", json::array({choice})}};
        };
        if (chat && *state == 0) {
          *state = 1;
          if (!send(chunk({{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"finish_reason", nullptr}}))) {
            cancel(job);
            return false;
          }
        }
        bool done = false;
        json meter;  // the meter so far, when a newer one arrived
        {
          std::unique_lock lock(job->mu);
          job->cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return job->done || !job->pieces.empty(); });
          if (take_pieces(*job, *reply)) cancel(job);
          done = job->done;
          if (job->live_meter_new) meter = std::move(job->live_meter), job->live_meter_new = false;
        }
        if (!sink.is_writable()) {
          cancel(job);
          return false;
        }
        const std::string text = reply->take(done);
        if (!text.empty() || reply->new_logprobs()) {
          json choice = {{"index", 0}, {"finish_reason", nullptr}};
          if (chat) choice["delta"] = {{"content", text}};
          else choice["text"] = text;
          choice["logprobs"] = job->logprobs ? reply->logprobs(chat) : json(nullptr);
          json c = chunk(choice);
          if (!meter.is_null()) c["witcert"] = std::move(meter);
          if (!send(c)) {
            cancel(job);
            return false;
          }
        }
        if (!done) return true;
        const engine::BatchResult& r = job->result;
        if (r.finish == engine::Finish::error) {
          send(error_json(result_error(r)));
          record(*job, "error", 0);
        } else {
          const std::string finish = finish_reason(*reply, r);
          json last = {{"index", 0}, {"finish_reason", finish}, {"logprobs", nullptr}};
          if (chat) last["delta"] = json::object();
          else last["text"] = "";
          send(chunk(last));
          json tail = {{"id", id}, {"object", object}, {"created", created}, {"model", opts_.model_name},
                       {"choices", json::array()}, {"witcert", witcert_object(*job, job->result, model_)}};
          if (job->include_usage) tail["usage"] = usage(*job, *reply);
          send(tail);
          record(*job, finish, reply->tokens());
        }
        const std::string end = "data: [DONE]\n\n";
        sink.write(end.data(), end.size());
        sink.done();
        *state = 2;
        return true;
      },
      [this, job, state](bool) {
        open_streams_ -= 1;
        if (*state != 2) {
          // The client went away before the end: its sequence is cancelled and counted once.
          cancel(job);
          std::unique_lock lock(job->mu);
          job->cv.wait(lock, [&] { return job->done; });
          lock.unlock();
          record(*job, "cancelled", static_cast<std::int64_t>(job->result.tokens.size()));
        }
      });
}

}  // namespace witcert::apps
