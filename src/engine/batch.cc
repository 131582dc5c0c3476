#include "engine/batch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace witcert::engine {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

std::int64_t pages_for(std::int64_t positions, int page_size) { return (positions + page_size - 1) / page_size; }

// Forwards the cells at positions ≥ first to every sink: a recomputed sequence reports each
// position once.
class FromPosition final : public gate::MeterSink {
 public:
  explicit FromPosition(std::vector<gate::MeterSink*> to) : to_(std::move(to)) {}
  void set_first(std::int64_t pos) { first_.store(pos, std::memory_order_relaxed); }
  void record(std::span<const gate::MeterCell> cells) override {
    const std::int64_t first = first_.load(std::memory_order_relaxed);
    // One attention call's cells come in position order.
    std::size_t i = 0;
    while (i < cells.size() && cells[i].pos < first) ++i;
    if (i < cells.size())
      for (gate::MeterSink* to : to_) to->record(cells.subspan(i));
  }

 private:
  std::vector<gate::MeterSink*> to_;
  std::atomic<std::int64_t> first_{0};
};

}  // namespace

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::stop: return "stop";
    case Finish::length: return "length";
    case Finish::error: return "error";
    case Finish::cancelled: return "cancelled";
  }
  return "?";
}

void BatchOptions::validate() const {
  require(max_seqs >= 1 && max_seqs <= 4096, "max_seqs must be in [1, 4096], got " + std::to_string(max_seqs));
  require(kv_memory >= 0, "kv_memory must not be negative, got " + std::to_string(kv_memory));
  require(prefill_chunk >= 1 && prefill_chunk <= 4096,
          "the prefill chunk must be in [1, 4096], got " + std::to_string(prefill_chunk));
  require(step_tokens >= 1, "step_tokens must be at least 1, got " + std::to_string(step_tokens));
}

struct BatchEngine::Seq {
  std::uint64_t id = 0;
  BatchRequest req;
  RequestEvents events;
  std::vector<std::int32_t> stop;
  BatchResult result;
  bool done = false;
  std::vector<std::int32_t> all;  // prompt, then the generated tokens
  std::int64_t prompt_len = 0;
  std::int64_t limit = 0;       // min(context, prompt + max_tokens): solo generate's cache capacity
  std::int64_t fed = 0;         // positions in the cache
  std::int64_t reported = 0;    // positions whose cells were reported (a recompute reports none again)
  std::int64_t admitted = 0;    // admission order: the youngest is preempted first
  Cache cache;
  std::unique_ptr<gate::Telemetry> telemetry;  // kept across a preemption
  std::unique_ptr<FromPosition> sink;
  model::Sampler sampler;
  int preemptions = 0;
  explicit Seq(const model::SamplerConfig& s) : sampler(s) {}
};

BatchEngine::BatchEngine(const model::LlamaModel& model, ThreadPool& pool, const CacheOptions& cache,
                         const BatchOptions& opts)
    : model_(model), threads_(pool), cache_(cache), opts_(opts) {
  cache_.validate();
  opts_.validate();
}

BatchEngine::~BatchEngine() = default;

std::size_t BatchEngine::live_bytes() const {
  std::size_t b = pool_.bytes();
  for (const Seq* s : running_)  // each certified sequence's own state measured as it stands
    if (s->cache.kv) b += s->cache.certified ? s->cache.certified->store().sequence().bytes() : sequence_bytes_;
  return b;
}

BatchLoad BatchEngine::load() const {
  BatchLoad l;
  l.running = static_cast<std::int64_t>(running_.size());
  l.waiting = static_cast<std::int64_t>(waiting_.size());
  if (!open_) return l;
  l.pool_pages = pool_.pages();
  l.free_pages = pool_.free_pages();
  l.cached_prefixes = static_cast<std::int64_t>(retired_.size());
  l.pool_bytes = live_bytes();
  return l;
}

std::optional<RequestSnapshot> BatchEngine::snapshot(std::uint64_t id) const {
  const auto it = std::find_if(seqs_.begin(), seqs_.end(), [id](const auto& s) { return s->id == id; });
  if (it == seqs_.end()) return std::nullopt;
  const Seq& s = **it;
  RequestSnapshot snap;
  snap.running = std::find(running_.begin(), running_.end(), &s) != running_.end();
  snap.so_far = s.result;  // before it finishes: the page-ins recorded at a preemption
  so_far(s, snap.so_far);
  return snap;
}

void BatchEngine::page_ins(const Seq& s, BatchResult& r) {
  if (!s.cache.certified) return;
  const kvcache::KvStore::PageInStats pi = s.cache.certified->store().page_in_stats();
  r.page_ins = pi.page_ins;
  r.page_in_bytes = pi.page_in_bytes;
  r.shared_page_ins = pi.shared_page_ins;
}

void BatchEngine::so_far(const Seq& s, BatchResult& r) {
  r.tokens.assign(s.all.begin() + s.prompt_len, s.all.end());
  r.prompt_tokens = s.prompt_len;
  r.preemptions = s.preemptions;
  page_ins(s, r);
  if (s.telemetry) {
    r.has_meter = true;
    r.meter = s.telemetry->summary();
    r.meter.page_ins = r.page_ins + r.shared_page_ins;
    r.heatmap = s.telemetry->heatmap();
    r.raw_histogram = s.telemetry->raw_histogram();
  }
}

void BatchEngine::release(Seq& s) {
  page_ins(s, s.result);  // kept for snapshots while it waits
  s.cache = Cache{};      // returns every page to the pool
}

void BatchEngine::make_room(std::int64_t pages) {
  while (pool_.free_pages() < pages && !retired_.empty()) retired_.erase(retired_.begin());
}

void BatchEngine::finish(Seq& s, Finish f, const std::string& error) {
  BatchResult& r = s.result;
  so_far(s, r);
  r.finish = f;
  r.error = error;
  if (opts_.share_prefixes && f != Finish::error && f != Finish::cancelled && s.cache.kv) {
    // Kept as a donor of its prompt's pages until they are needed (a cancelled sequence's pages
    // go back at once).
    Cache kept = std::move(s.cache);
    s.cache = Cache{};
    retired_.push_back({std::vector<std::int32_t>(s.all.begin(), s.all.begin() + s.prompt_len),
                        std::min(s.fed, s.prompt_len), std::move(kept)});
    if (static_cast<int>(retired_.size()) > opts_.max_seqs) retired_.erase(retired_.begin());
  } else {
    s.cache = Cache{};  // every page back to the pool; its page-ins are in r
  }
  s.done = true;
  if (s.events.on_done) s.events.on_done(r);
}

void BatchEngine::admit() {
  const int P = pool_.page_size();
  while (!waiting_.empty() && static_cast<int>(running_.size()) < opts_.max_seqs) {
    Seq& s = *waiting_.front();
    // Its known tokens and the next one must fit beside one new page for every running sequence.
    const std::int64_t need = pages_for(static_cast<std::int64_t>(s.all.size()) + 1, P);
    make_room(need + static_cast<std::int64_t>(running_.size()));
    if (!running_.empty() && pool_.free_pages() < need + static_cast<std::int64_t>(running_.size())) return;
    const model::LlamaConfig& cfg = model_.config();
    std::vector<gate::MeterSink*> sinks;
    if (cache_.certified) {
      if (!s.telemetry)
        s.telemetry = std::make_unique<gate::Telemetry>(
            cfg.layers, cfg.heads,
            gate::Telemetry::Options{s.req.coverage_tau, s.req.coverage_tau_v, s.req.cache.bound, s.prompt_len});
      std::vector<gate::MeterSink*> to = {s.telemetry.get()};
      to.insert(to.end(), s.req.sinks.begin(), s.req.sinks.end());
      s.sink = std::make_unique<FromPosition>(std::move(to));
      sinks.push_back(s.sink.get());
    }
    s.cache = make_sequence_cache(pool_, cfg, s.req.max_tokens, s.req.cache, sinks);
    s.cache.kv->set_prompt_length(s.prompt_len);  // as Session::prefill announces it
    s.fed = 0;
    if (opts_.share_prefixes) share_prefix(s);
    s.admitted = ++admissions_;
    waiting_.erase(waiting_.begin());
    running_.push_back(&s);
  }
}

void BatchEngine::share_prefix(Seq& s) {
  // Whole chunks keep the prefill's chunk boundaries (and so every result) as they are alone;
  // whole pages and group blocks are what a cache can share.
  std::int64_t unit = std::lcm<std::int64_t>(opts_.prefill_chunk, cache_.page_size);
  if (cache_.certified)
    for (const formats::KvSide side : {formats::KvSide::key, formats::KvSide::value}) {
      const formats::KvFormat& f = side == formats::KvSide::key ? cache_.k_format : cache_.v_format;
      if (f.kind() == formats::FormatKind::scheme) unit = std::lcm<std::int64_t>(unit, f.scheme(side)->tokens_per_block());
    }
  // Longest first; a donor whose repairs differ from this sequence's refuses, and the next is tried.
  std::vector<std::pair<std::int64_t, const kvcache::KvCache*>> donors;
  const auto consider = [&](const std::vector<std::int32_t>& tokens, std::int64_t prompt_len, std::int64_t fed,
                            const kvcache::KvCache* cache) {
    const std::int64_t limit = std::min({s.prompt_len - 1, prompt_len, fed});
    std::int64_t common = 0;
    while (common < limit && s.all[common] == tokens[common]) ++common;
    const std::int64_t n = common / unit * unit;
    if (n > 0) donors.emplace_back(n, cache);
  };
  for (const Seq* d : running_) consider(d->all, d->prompt_len, d->fed, d->cache.kv.get());
  for (const Retired& d : retired_)
    consider(d.prompt, static_cast<std::int64_t>(d.prompt.size()), d.fed, d.cache.kv.get());
  std::stable_sort(donors.begin(), donors.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [n, donor] : donors)
    if (s.cache.kv->share_prefix(*donor, n)) {
      s.fed = n;
      stats_.shared_tokens += n;
      return;
    }
}

std::string BatchEngine::check(const BatchRequest& q) const {
  const model::LlamaConfig& cfg = model_.config();
  try {
    require(!q.prompt.empty(), "the prompt is empty");
    require(static_cast<std::int64_t>(q.prompt.size()) <= cfg.context,
            "the prompt has " + std::to_string(q.prompt.size()) + " tokens, more than the context of " +
                std::to_string(cfg.context));
    require(q.max_tokens >= 0, "max_tokens must not be negative, got " + std::to_string(q.max_tokens));
    model::Sampler{q.sampler};
    q.cache.validate();
    require(q.cache.certified == cache_.certified && q.cache.k_format.name() == cache_.k_format.name() &&
                q.cache.v_format.name() == cache_.v_format.name() && q.cache.page_size == cache_.page_size,
            "a request's formats and page size are the pool's");
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void BatchEngine::build_pool(std::int64_t capacity, std::int64_t pages, bool exact_tier) {
  retired_.clear();
  capacity_ = capacity;
  pool_ = make_pool(model_.config(), capacity_, std::max<std::int64_t>(pages, 1), cache_, exact_tier);
  sequence_bytes_ = pool_.sequence_bytes();
  stats_.pool_pages = pool_.pages();
  stats_.pool_bytes = pool_.bytes();
  stats_.backing_bytes = pool_.backing_bytes();
  stats_.sequence_bytes = sequence_bytes_;
  open_ = true;
}

void BatchEngine::open(std::int64_t capacity, bool exact_tier) {
  require(!open_, "the batch engine's pool is already open");
  const model::LlamaConfig& cfg = model_.config();
  capacity = std::clamp<std::int64_t>(capacity, 1, cfg.context);
  std::int64_t pages = opts_.max_seqs * pages_for(capacity, cache_.page_size);
  if (opts_.kv_memory > 0) {
    pages = size_pool(cfg, capacity, cache_, opts_.kv_memory, opts_.max_seqs).pages;
    check_kv_memory(cfg, cache_, opts_.kv_memory, pages, exact_tier, available_memory());
  }
  build_pool(capacity, pages, exact_tier);
}

std::uint64_t BatchEngine::submit(const BatchRequest& request, RequestEvents events,
                                  std::vector<std::int32_t> stop_tokens) {
  require(open_, "submit before open");
  const model::LlamaConfig& cfg = model_.config();
  const int P = cache_.page_size;
  // Checked before anything is built from it: a sampler that refuses its settings must fail this
  // request alone, not the caller's whole run.
  std::string error = check(request);
  auto s = std::make_unique<Seq>(error.empty() ? request.sampler : model::SamplerConfig{});
  s->id = ++next_id_;
  s->req = request;
  s->events = std::move(events);
  s->stop = std::move(stop_tokens);
  s->all = request.prompt;
  s->prompt_len = static_cast<std::int64_t>(request.prompt.size());
  s->limit = std::min<std::int64_t>(cfg.context, s->prompt_len + request.max_tokens);
  if (error.empty() && (request.cache.gate.on() || request.cache.check_soundness) && !pool_.has_exact_tier())
    error = "the request's gate or soundness check needs the exact tier, which this pool does not keep";
  if (error.empty() && s->limit > capacity_)
    error = "the request needs " + std::to_string(s->limit) + " positions, more than the pool's sequences hold (" +
            std::to_string(capacity_) + ")";
  if (error.empty() && pages_for(s->limit, P) > pool_.pages())
    error = "the request needs " + std::to_string(pages_for(s->limit, P)) + " pages of " + std::to_string(P) +
            " tokens, more than the pool's " + std::to_string(pool_.pages()) + " (a larger kv_memory)";
  const std::uint64_t id = s->id;
  if (!error.empty()) {
    finish(*s, Finish::error, error);
  } else if (request.max_tokens == 0) {
    finish(*s, Finish::length);
  } else {
    waiting_.push_back(s.get());
    seqs_.push_back(std::move(s));
  }
  return id;
}

bool BatchEngine::cancel(std::uint64_t id) {
  const auto it = std::find_if(seqs_.begin(), seqs_.end(), [id](const auto& s) { return s->id == id; });
  if (it == seqs_.end()) return false;
  Seq& s = **it;
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &s), waiting_.end());
  running_.erase(std::remove(running_.begin(), running_.end(), &s), running_.end());
  finish(s, Finish::cancelled);
  seqs_.erase(it);
  return true;
}

void BatchEngine::step() {
  if (idle()) return;
  const model::LlamaConfig& cfg = model_.config();
  const int P = pool_.page_size();
  admit();
  // Oldest first; a sequence that does not fit preempts the youngest not yet in this step.
  std::sort(running_.begin(), running_.end(), [](const Seq* a, const Seq* b) { return a->admitted < b->admitted; });
  rows_.clear();
  row_seq_.clear();
  std::int64_t used = 0, claimed = 0;
  for (std::size_t k = 0; k < running_.size(); ++k) {
    Seq& s = *running_[k];
    const std::int64_t n = s.fed < s.prompt_len
                               ? std::min<std::int64_t>((s.fed / opts_.prefill_chunk + 1) * opts_.prefill_chunk,
                                                        s.prompt_len) - s.fed
                               : 1;
    if (!rows_.empty() && used + n > opts_.step_tokens) continue;
    const std::int64_t held = pages_for(s.fed, P);
    const std::int64_t need = pages_for(s.fed + n, P) - held;
    make_room(claimed + need);
    while (pool_.free_pages() - claimed < need && running_.size() > k + 1) {
      Seq& young = *running_.back();  // the youngest: preempted, recomputed later from its tokens
      release(young);
      young.preemptions += 1;
      stats_.preemptions += 1;
      waiting_.insert(waiting_.begin(), &young);
      running_.pop_back();
    }
    if (pool_.free_pages() - claimed < need) {
      if (!rows_.empty() || k > 0) continue;  // waits for a later step
      throw std::logic_error("batch: a lone sequence does not fit the pool");  // excluded by submit's page check
    }
    claimed += need;
    used += n;
    if (s.sink) s.sink->set_first(s.reported);
    rows_.push_back({std::span<const std::int32_t>(s.all).subspan(s.fed, n), s.fed, s.cache.kv.get(), false, true});
    row_seq_.push_back(&s);
  }
  const std::size_t V = static_cast<std::size_t>(cfg.vocab);
  logits_.resize(rows_.size() * V);
  bool decode_only = true;
  for (std::size_t r = 0; r < rows_.size(); ++r)
    decode_only = decode_only && rows_[r].tokens.size() == 1 && row_seq_[r]->fed >= row_seq_[r]->prompt_len;
  const auto step0 = std::chrono::steady_clock::now();
  model_.forward_batch(rows_, threads_, logits_);
  if (decode_only) {
    stats_.decode_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - step0).count();
    stats_.decode_tokens += static_cast<std::int64_t>(rows_.size());
  }
  stats_.steps += 1;
  stats_.max_running = std::max<std::int64_t>(stats_.max_running, static_cast<std::int64_t>(rows_.size()));
  stats_.peak_bytes = std::max(stats_.peak_bytes, live_bytes());

  for (std::size_t r = 0; r < rows_.size(); ++r) {
    Seq& s = *row_seq_[r];
    const std::int64_t n = static_cast<std::int64_t>(rows_[r].tokens.size());
    stats_.tokens += n;
    s.fed += n;
    s.reported = std::max(s.reported, s.fed);
    if (!rows_[r].logits_ok) {
      s.result.non_finite = true;
      finish(s, Finish::error, "non-finite logits at position " + std::to_string(s.fed - 1) +
                                   " (NaN or Inf in the activations)");
      continue;
    }
    if (s.fed < static_cast<std::int64_t>(s.all.size())) continue;  // the prompt or a recompute goes on
    // As engine::decode: sample, stop at a stop token, end at the budget or the limit.
    const std::int32_t next = s.sampler.sample(std::span<const float>(&logits_[r * V], V));
    stats_.generated += 1;
    if (std::find(s.stop.begin(), s.stop.end(), next) != s.stop.end()) {
      finish(s, Finish::stop);
      continue;
    }
    s.all.push_back(next);
    const std::int64_t generated = static_cast<std::int64_t>(s.all.size()) - s.prompt_len;
    if (s.telemetry && s.events.on_meter && s.events.meter_every > 0 && generated % s.events.meter_every == 0) {
      gate::TelemetrySummary m = s.telemetry->summary();
      BatchResult pi;
      page_ins(s, pi);
      m.page_ins = pi.page_ins + pi.shared_page_ins;
      s.events.on_meter(m);
    }
    if (s.events.on_token) s.events.on_token(next, std::span<const float>(&logits_[r * V], V));
    if (static_cast<std::int64_t>(s.all.size()) - s.prompt_len == s.req.max_tokens || s.fed >= s.limit)
      finish(s, Finish::length);
  }
  // Finished sequences leave (their cache is already released or retired).
  running_.erase(std::remove_if(running_.begin(), running_.end(), [](const Seq* s) { return s->done; }),
                 running_.end());
  seqs_.erase(std::remove_if(seqs_.begin(), seqs_.end(), [](const auto& s) { return s->done; }), seqs_.end());
}

std::vector<BatchResult> BatchEngine::run(const std::vector<BatchRequest>& requests,
                                          const std::vector<std::int32_t>& stop_tokens, const ResultSink& on_done) {
  const auto t0 = std::chrono::steady_clock::now();
  const model::LlamaConfig& cfg = model_.config();
  stats_ = BatchStats{};
  retired_.clear();
  open_ = false;

  // The pool: the budget's pages, or room for the max_seqs largest valid requests at once, with
  // the exact tier when any of them reads it.
  bool tier = cache_.gate.on() || cache_.check_soundness;
  std::int64_t capacity = 1;
  std::vector<std::int64_t> need;
  for (const BatchRequest& q : requests) {
    if (!check(q).empty()) continue;
    tier = tier || q.cache.gate.on() || q.cache.check_soundness;
    const std::int64_t limit = std::min<std::int64_t>(cfg.context, static_cast<std::int64_t>(q.prompt.size()) + q.max_tokens);
    capacity = std::max(capacity, limit);
    need.push_back(pages_for(limit, cache_.page_size));
  }
  if (opts_.kv_memory > 0) {
    open(capacity, tier);
  } else {
    std::sort(need.rbegin(), need.rend());
    std::int64_t pages = 0;
    for (std::size_t i = 0; i < need.size() && static_cast<int>(i) < opts_.max_seqs; ++i) pages += need[i];
    build_pool(capacity, pages, tier);
  }

  std::vector<BatchResult> results(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    RequestEvents events;
    events.on_done = [&results, &on_done, i](const BatchResult& r) {
      results[i] = r;
      if (on_done) on_done(i, r);
    };
    submit(requests[i], std::move(events), stop_tokens);
  }
  while (!idle()) step();
  retired_.clear();
  open_ = false;
  stats_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return results;
}

BatchResult run_alone(const model::LlamaModel& model, ThreadPool& threads, const BatchRequest& request,
                      std::vector<std::int32_t> stop_tokens, const TokenHandler& on_token) {
  BatchOptions opts;
  opts.max_seqs = 1;
  opts.share_prefixes = false;
  BatchEngine engine(model, threads, request.cache, opts);
  const std::int64_t limit =
      std::min<std::int64_t>(model.config().context, static_cast<std::int64_t>(request.prompt.size()) + request.max_tokens);
  engine.open(limit, request.cache.gate.on() || request.cache.check_soundness);
  BatchResult result;
  bool end = false;
  RequestEvents events;
  if (on_token)
    events.on_token = [&](std::int32_t token, std::span<const float> logits) { end = end || on_token(token, logits); };
  events.on_done = [&](const BatchResult& r) { result = r; };
  const std::uint64_t id = engine.submit(request, std::move(events), std::move(stop_tokens));
  while (!engine.idle()) {
    engine.step();
    if (end) engine.cancel(id);  // between steps: no forward pass runs for the last token
  }
  if (result.finish == Finish::error) {
    if (result.non_finite) throw model::NonFiniteError(result.error);
    throw std::invalid_argument(result.error);
  }
  return result;
}

}  // namespace witcert::engine
