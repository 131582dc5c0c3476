// Many requests over one shared pool (continuous batching): each engine step runs one token of
// every decoding sequence and a prefill chunk of the others in one forward pass, admits waiting
// requests while their pages fit, and preempts the youngest sequence when the pool runs out
// (it is recomputed later, position for position as it first ran). Each sequence's tokens,
// logits and meters are bit for bit those of its run alone (the batch-invariance guarantee):
// every token's products keep their order in the batched pass, prefill chunks start at the same
// positions, and a page's dither is named by the sequence that writes it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/thread_pool.h"
#include "engine/cache_factory.h"
#include "engine/options.h"
#include "gate/telemetry.h"
#include "model/llama.h"
#include "model/sampler.h"

namespace witcert::engine {

// One request of a batch: its prompt tokens, budget, sampling and meter policy (gate, δ, bound:
// the cache options' own fields; the formats and page size are the pool's).
struct BatchRequest {
  std::vector<std::int32_t> prompt;
  int max_tokens = 128;
  model::SamplerConfig sampler;
  CacheOptions cache;          // certified with the pool's formats; its gate, δ, bound, check apply
  double coverage_tau = 0.2;   // τ_K of the coverage figures
  double coverage_tau_v = 0.05;
  // Hear the request's meter cells beside its telemetry, each position once (a recompute after a
  // preemption reports none again); not owned, they outlive the request. Certified caches only.
  std::vector<gate::MeterSink*> sinks;

  void set_policy(const RequestPolicy& p) {
    cache = p.cache;
    coverage_tau = p.coverage_tau;
    coverage_tau_v = p.coverage_tau_v;
  }
};

enum class Finish { stop, length, error, cancelled };
const char* finish_name(Finish f);  // "stop", "length", "error", "cancelled"

struct BatchResult {
  std::vector<std::int32_t> tokens;  // generated, stop token excluded
  std::int64_t prompt_tokens = 0;
  Finish finish = Finish::length;
  std::string error;                 // Finish::error: what went wrong
  bool non_finite = false;           // Finish::error from NaN or Inf in the activations
  bool has_meter = false;            // certified cache: the summary and page-ins below are set
  gate::TelemetrySummary meter;      // the request's decode-step cells
  std::vector<double> heatmap;       // mean served meter per (layer, query head), row-major
  gate::Telemetry::RawHistogram raw_histogram;  // raw scores before repair, per gate::kRawScoreBounds
  std::int64_t page_ins = 0, page_in_bytes = 0;
  // Repairs taken over with a shared prefix: the donor paged them in, and its page_ins count them.
  std::int64_t shared_page_ins = 0;
  int preemptions = 0;               // times the sequence was preempted and recomputed
};

struct BatchOptions {
  int max_seqs = 16;           // sequences running at once
  // Bytes of the pool (0: enough for the max_seqs largest requests at once): a budget, committed
  // as pages are written, at most the memory this machine has available.
  std::int64_t kv_memory = 0;
  int prefill_chunk = 64;      // prompt tokens per sequence per step, from position 0 in whole chunks
  std::int64_t step_tokens = 512;  // tokens per step, over every row (at least one row always runs)
  // A new sequence whose prompt begins with a running or recently finished sequence's takes
  // those positions' pages instead of computing them (whole prefill chunks, pages and group
  // blocks). With a gate on either side, only between requests whose repairs are the same
  // (gate::CertifiedKvCache::share_prefix); the donor's repairs of the shared prompt come with
  // its pages and are paged in once. A finished sequence's pages stay as a donor until a step or
  // an admission needs them, oldest first.
  bool share_prefixes = true;

  // Throws std::invalid_argument: max_seqs ∉ [1, 4096], kv_memory < 0, chunk ∉ [1, 4096], step_tokens < 1.
  void validate() const;
};

struct BatchStats {
  std::int64_t pool_pages = 0;
  std::size_t pool_bytes = 0, backing_bytes = 0, sequence_bytes = 0;  // measured
  std::size_t peak_bytes = 0;         // max over steps of pool bytes + live sequences' own bytes
  std::int64_t steps = 0, tokens = 0;  // forward passes and tokens run (prefill, decode, recompute)
  std::int64_t generated = 0;          // tokens sampled
  std::int64_t max_running = 0;        // most sequences in one step
  std::int64_t preemptions = 0;
  std::int64_t shared_tokens = 0;      // prompt positions taken from another sequence's pages
  double seconds = 0.0;
  // Steps whose rows were all single decode tokens: their time and the tokens they ran.
  double decode_seconds = 0.0;
  std::int64_t decode_tokens = 0;
};

// Receives each request's result as it finishes (index into the request list).
using ResultSink = std::function<void(std::size_t index, const BatchResult& result)>;

// What a submitted request's owner hears, on the thread that runs step(): every sampled token as
// it is accepted (a stop token is not) with the logits it was sampled from, then the result, once.
struct RequestEvents {
  std::function<void(std::int32_t token, std::span<const float> logits)> on_token;
  std::function<void(const BatchResult& result)> on_done;
  // With a certified cache, called before on_token after every meter_every-th generated token (0:
  // never) with the request's meter so far (its page_ins set), between forward passes.
  int meter_every = 0;
  std::function<void(const gate::TelemetrySummary& so_far)> on_meter;
};

// A submitted request while it is in the engine (BatchEngine::snapshot).
struct RequestSnapshot {
  bool running = false;  // admitted: holding pages (false: waiting, or preempted and waiting)
  // So far: the tokens generated, the meter of the decode steps served (has_meter, meter,
  // heatmap, raw_histogram) and the page-ins; finish and error are not set.
  BatchResult so_far;
};

// The pool's occupancy between steps.
struct BatchLoad {
  std::int64_t running = 0, waiting = 0;
  std::int64_t pool_pages = 0, free_pages = 0;
  std::int64_t cached_prefixes = 0;  // finished sequences kept as prefix donors (their pages are taken)
  std::size_t pool_bytes = 0;  // measured: pages, metadata and the running sequences' own state
};

class BatchEngine {
 public:
  // The model and pool must outlive the engine. cache: the pool's formats, page size and
  // default policy. Throws std::invalid_argument for bad options.
  BatchEngine(const model::LlamaModel& model, ThreadPool& pool, const CacheOptions& cache, const BatchOptions& opts);
  ~BatchEngine();

  // Runs every request to completion. A request that cannot run (an empty prompt, one beyond the
  // context, more pages than the pool holds, an invalid policy) or whose activations turn
  // non-finite gets Finish::error and its message; the others run on. stop_tokens end a request.
  std::vector<BatchResult> run(const std::vector<BatchRequest>& requests, const std::vector<std::int32_t>& stop_tokens,
                               const ResultSink& on_done = {});
  const BatchStats& stats() const { return stats_; }

  // Serving, one thread: open() builds the pool once for sequences of up to `capacity` positions
  // (BatchOptions::kv_memory's pages, or max_seqs such sequences), with the exact tier that a gate
  // or soundness check reads when `exact_tier`; then submit() queues requests between steps,
  // step() runs one forward pass (admission, preemption, sampling, events) and cancel() ends a
  // request at once, its pages back in the pool. A request that cannot run gets Finish::error
  // from submit itself. The pool's pages take memory only as they are written; open() throws
  // std::invalid_argument for a kv_memory this machine cannot hold (check_kv_memory).
  void open(std::int64_t capacity, bool exact_tier);
  std::uint64_t submit(const BatchRequest& request, RequestEvents events, std::vector<std::int32_t> stop_tokens);
  bool cancel(std::uint64_t id);  // false: no such request (finished already)
  bool idle() const { return running_.empty() && waiting_.empty(); }
  void step();
  BatchLoad load() const;
  // A request's counters as they stand, on the thread that runs step(), between steps: it reads
  // the request's telemetry without holding up anything a step uses. nullopt: no such request in
  // the engine (finished already, or never submitted).
  std::optional<RequestSnapshot> snapshot(std::uint64_t id) const;

 private:
  struct Seq;
  // Why a request cannot run ("" when it can): an empty prompt, one beyond the context, an invalid
  // policy or sampler, formats or page size other than the pool's.
  std::string check(const BatchRequest& q) const;
  void admit();
  // Shares the longest whole-chunk prefix of s's prompt that a running or retired sequence has
  // written and may give it (the cache's share_prefix refuses a donor that repairs otherwise).
  void share_prefix(Seq& s);
  // Frees retired donors, oldest first, until `pages` pages are free or none is left.
  void make_room(std::int64_t pages);
  // The request's result as it stands: tokens so far, its meter, and the page-ins of its live cache.
  static void so_far(const Seq& s, BatchResult& r);
  static void page_ins(const Seq& s, BatchResult& r);  // those of its live cache, if it has one
  void build_pool(std::int64_t capacity, std::int64_t pages, bool exact_tier);
  void release(Seq& s);
  void finish(Seq& s, Finish f, const std::string& error = "");
  std::size_t live_bytes() const;

  const model::LlamaModel& model_;
  ThreadPool& threads_;
  CacheOptions cache_;
  BatchOptions opts_;
  Pool pool_;
  std::int64_t capacity_ = 0;
  std::size_t sequence_bytes_ = 0;
  std::int64_t admissions_ = 0;
  struct Retired {  // a finished sequence's cache, kept as a prefix donor
    std::vector<std::int32_t> prompt;
    std::int64_t fed = 0;
    Cache cache;
  };
  std::vector<Retired> retired_;
  BatchStats stats_;
  bool open_ = false;
  std::uint64_t next_id_ = 0;
  std::vector<std::unique_ptr<Seq>> seqs_;  // every request not yet finished
  std::vector<Seq*> waiting_, running_;     // running_: in admission order after each step's sort
  // The step's rows, kept between steps so that a decode step allocates nothing new.
  std::vector<model::BatchRow> rows_;
  std::vector<Seq*> row_seq_;
  std::vector<float> logits_;
};

// Hears each sampled token with the logits it came from; true ends the request there.
using TokenHandler = std::function<bool(std::int32_t token, std::span<const float> logits)>;

// One request alone, as a batch of one over a pool of its own size: what `generate`, the C API and
// Python run, so that one loop serves every request. Throws what the request's error would say:
// model::NonFiniteError for non-finite activations, std::invalid_argument otherwise.
BatchResult run_alone(const model::LlamaModel& model, ThreadPool& threads, const BatchRequest& request,
                      std::vector<std::int32_t> stop_tokens, const TokenHandler& on_token = {});

}  // namespace witcert::engine
