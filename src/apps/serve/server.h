// `witcert serve`: an OpenAI-compatible HTTP server over the multi-sequence engine
// (engine/batch.h). Every response carries its request's meter in a `witcert` object beside
// `usage`; /metrics exposes the server's counters in Prometheus's text format; /health answers
// 503 until the model is loaded. One engine thread runs the steps; requests join the running
// batch between steps, and a client that goes away cancels its sequence at the next step.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/serve/connection.h"
#include "apps/serve/metrics.h"
#include "apps/serve/request.h"
#include "engine/batch.h"
#include "engine/model.h"

namespace httplib {
struct Request;
struct Response;
}  // namespace httplib

namespace witcert::apps {

struct ServeOptions {
  std::string model_path;        // the GGUF file
  engine::CacheOptions cache;    // the pool's formats and the default policy of every request
  engine::BatchOptions batch;    // max_seqs, kv_memory, ...
  double coverage_tau = 0.2;     // default τ_K of the coverage figures (the gate's τ when gated)
  double coverage_tau_v = 0.05;
  int threads = 2;
  std::string host = "127.0.0.1";
  int port = 8080;               // 0: any free port
  std::string api_key;           // "": no authentication (the CLI refuses an empty --api-key)
  int max_tokens = 256;          // a request's max_tokens when it gives none
  int max_waiting = 64;          // requests queued beyond the running batch; more get 503
  std::size_t max_body = 1 << 20;  // bytes of a request body, decompressed; more get 413
  ConnectionLimits connections;    // open connections and the deadlines of a request's reading
  std::string model_name;        // the id /v1/models lists ("" → the GGUF file's stem)
};

class Server {
 public:
  explicit Server(ServeOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds host:port (port 0 picks a free one), starts serving, and loads the model and builds the
  // pool in the background; /health answers 503 until both are done. Returns the bound port.
  // Throws std::runtime_error when the address cannot be bound.
  int start();
  // Blocks until the model is loaded and the pool built (true), or either failed (false, with
  // load_error(): a missing model, a --kv-memory that holds no sequence).
  bool wait_ready();
  std::string load_error() const;
  // Stops accepting requests (new ones get 503), lets running ones finish for up to `deadline`,
  // cancels the rest, then stops the engine and the listener. Idempotent.
  void shutdown(std::chrono::milliseconds deadline);

  const Metrics& metrics() const { return metrics_; }
  bool draining() const { return draining_; }  // shutdown has begun: new requests get 503
  int port() const { return port_; }

  struct Job;  // one request's exchange between its handler and the engine thread

 private:
  // The engine thread: loads the model, builds the pool, then runs steps until shutdown.
  void engine_loop();
  void fail_start(const std::string& error);  // /health and wait_ready report it
  void route();
  // The request's job from its JSON body; throws the OpenAI-style error (400) naming the field.
  std::shared_ptr<Job> parse(const std::string& body, bool chat);
  // `body` is the request's body as read (decompressed) by the route.
  void serve_completion(const std::string& body, httplib::Response& res, bool chat);
  bool enqueue(const std::shared_ptr<Job>& job);  // false: the queue is full or the server is draining
  void cancel(const std::shared_ptr<Job>& job);
  // Sets the job's result (engine thread) and wakes its handler.
  void complete(Job& job, const engine::BatchResult& result);
  // Adds a finished request to the metrics, with the completion tokens its response reports.
  void record(const Job& job, const std::string& finish, std::int64_t completion_tokens);
  void publish_load(const engine::BatchLoad& load);
  // GET /v1/witcert/requests: every request in the engine with its counters so far. The handler
  // queues a query and the engine thread answers it between two steps (answer_queries).
  nlohmann::json live_requests();
  void answer_queries(const engine::BatchEngine& eng,
                      const std::vector<std::pair<std::uint64_t, std::shared_ptr<Job>>>& live);
  // The dashboard's state: a new sample of the load and meter counters appended to the last 600,
  // and the recent requests' mean K meter per (layer, query head).
  nlohmann::json state();
  // Appends a sample of the load and meter counters (each poll of the state and each finished
  // request, so that a load shows on the plots before the next poll).
  void sample();

  ServeOptions opts_;
  RequestDefaults defaults_;  // what a request body leaves out, from opts_
  Metrics metrics_;
  std::unique_ptr<GuardedServer> http_;
  std::thread listener_, engine_;
  int port_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // engine thread: work arrived; waiters: the model is loaded
  engine::Model model_;
  std::vector<std::int32_t> stop_tokens_;
  bool loaded_ = false, load_failed_ = false, stopping_ = false;
  std::string load_error_;
  std::vector<std::shared_ptr<Job>> inbox_;   // submitted, not yet handed to the engine
  std::vector<std::promise<nlohmann::json>> queries_;  // live_requests, not yet answered
  bool engine_done_ = false;                  // the engine thread has ended: no query is answered
  // Jobs queued and not finished: counted down when the engine finishes one, before its handler
  // hears of it, so that the queue limit and the drain never count a finished request.
  std::int64_t pending_ = 0;
  std::atomic<bool> draining_{false};
  std::atomic<bool> listener_done_{false};
  std::atomic<int> open_streams_{0};  // event streams not yet ended: shutdown lets them send [DONE]
  std::atomic<std::uint64_t> next_id_{0};
  std::chrono::system_clock::time_point started_;

  std::mutex state_mu_;  // the dashboard's samples and heatmap
  std::deque<nlohmann::json> samples_;
  std::vector<double> heat_;
  int heat_layers_ = 0, heat_heads_ = 0;
  std::deque<std::string> verdicts_;  // the verdicts of the last kRecentVerdicts finished requests
  std::string at_risk_reason_;        // the reason of the latest at-risk one
};

}  // namespace witcert::apps
