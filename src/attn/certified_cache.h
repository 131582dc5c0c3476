// The certified KV cache behind the model's KvCache interface: packed formats in a paged pool
// with an exact backing tier (cache/kv_store.h), attention whose output and meter come from one
// pass (attn/certified_attention.h), and a log of every (layer, query head, position) meter.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "attn/certified_attention.h"
#include "attn/kv_cache.h"
#include "cache/kv_store.h"
#include "cert/meter.h"

namespace witcert::attn {

// The gate (§4.3, §5 "Joint K+V", §6.3.4–6.3.5): when any query head of a (layer, KV head) group
// fails pass_K ∧ pass_V — its K meter above τ_K or its V meter above τ_V — repair pages from the
// exact tier and recompute the step's attention. τ_K < 1 is certified gating on the clamped K
// meter; τ_K ≥ 1 is risk-ranked gating on the raw score.
enum class Granularity {
  head,     // every page of the (layer, KV head)
  block,    // pages in decreasing order of their term of A, until the meter is under τ
  request,  // every page of every (layer, KV head) of the request
};

// "head", "block", "request"; parse_granularity throws std::invalid_argument on anything else.
const char* granularity_name(Granularity g);
Granularity parse_granularity(std::string_view name);

struct GateOptions {
  double tau = 0.0;     // τ_K; 0: no gate
  Granularity granularity = Granularity::block;
  double tau_v = 0.05;  // τ_V
  bool on() const { return tau != 0.0; }
  bool certified() const { return tau < 1.0; }
};

// One (layer, query head, position) cell.
struct MeterCell {
  int layer;
  int q_head;
  std::int64_t pos;     // the query's position; it attends over [0, pos]
  double eform_raw;     // Theorem 1 unclamped: the risk score (+inf: no guarantee)
  double meter;         // the K meter: the chosen bound shape, clamped to 1
  double v_meter;       // the V meter
  double tv;            // the true TV (NaN unless check_soundness)
  double raw_before;    // the step's values before its own repair (= the served ones when not repaired)
  double meter_before;
  double v_meter_before;
  bool repaired;
};

// Receives the cells of every attention call as it is served, from several threads at once: the
// telemetry aggregates them in place instead of the cache keeping a log that grows with the request.
class MeterSink {
 public:
  virtual ~MeterSink() = default;
  virtual void record(std::span<const MeterCell> cells) = 0;
};

struct CertifiedOptions {
  int q_heads = 1;                  // query heads per layer (H in δ_loc = δ_req/(L·H·T))
  double delta_req = 1e-2;          // request-level failure budget of Tier B
  std::int64_t decode_budget = 256; // T
  int splits = 1;                   // split-KV partitions per attention call, merged under LSE weights
  bool check_soundness = false;     // also compute the true TV of every cell from the exact tier
  cert::BoundShape bound = cert::BoundShape::min;  // the K meter's shape (retention: a second pass)
  GateOptions gate;
  MeterSink* sink = nullptr;        // receives every served cell (not owned; must outlive the cache)
  bool keep_cells = true;           // also keep every cell for cells()
};

class CertifiedKvCache final : public KvCache {
 public:
  // Throws std::invalid_argument for an impossible δ or τ, an unknown format or a bad shape. The
  // exact backing tier is allocated only when the gate or the soundness check needs it
  // (cfg.exact_tier is then set to at least ExactTier::ram).
  CertifiedKvCache(const cache::CacheConfig& cfg, const CertifiedOptions& opts);

  const KvGeometry& geometry() const override { return g_; }
  void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) override;
  void attend(int layer, int kv_head, const float* q, int group, std::int64_t n_ctx, float* out) const override;
  // Reads the shared prefix [0, pos0) once for the run's n positions; the gate then acts on each
  // position as attend does.
  void attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group, std::int64_t pos0,
                     std::int64_t n, float* out, std::int64_t out_stride) const override;
  void clear() override;
  void set_prompt_length(std::int64_t n) override { store_.set_prompt_length(n); }
  // Repairs promote pages that later calls read: per_head when gated by head or block, serial
  // when a repair promotes every head (request granularity).
  AttendConcurrency attend_concurrency() const override;

  const cache::KvStore& store() const { return store_; }
  // Turns the true-TV check on or off for the cells that follow (between forward passes, not
  // during one), so that a study can check only the cells it counts. Throws std::logic_error when
  // the cache was built without the exact tier (construct it with check_soundness).
  void set_check_soundness(bool on);
  std::vector<MeterCell> cells() const;  // empty unless keep_cells

 private:
  struct Group;  // the results of one attention call
  void compute(cache::KvStore::Reader& reader, const float* q, int group, std::int64_t n_ctx, Group& g) const;
  // The step's attention over [0, n_ctx) from the stored formats, or the plain exact path when
  // every token of the (layer, KV head) is served exact.
  void compute_step(cache::KvStore::Reader& reader, const float* q, int group, std::int64_t n_ctx, Group& g) const;
  // Gates one position's computed attention (repairing and recomputing while triggered), writes
  // its output and appends its cells.
  void serve(cache::KvStore::Reader& reader, int layer, int kv_head, const float* q, int group, std::int64_t n_ctx,
             Group& g, float* out, std::vector<MeterCell>& cells) const;
  void log(const std::vector<MeterCell>& cells) const;
  // The output and meters of every head from the group's merged partials (retention: with its
  // second pass).
  void finish_group(cache::KvStore::Reader& reader, const float* q, std::int64_t n_ctx, Group& g) const;
  bool pass_k(const HeadResult& r) const;
  bool pass_v(const HeadResult& r) const;
  bool triggered(const Group& g) const;
  // Block granularity: narrows `order` (the unpromoted pages) to the pages to promote; false
  // when no plan can be made (a non-finite term), leaving every page in it.
  bool plan_blocks(cache::KvStore::Reader& reader, const float* q, int group, std::int64_t n_ctx, const Group& g,
                   std::vector<std::int64_t>& order) const;
  // Promotes pages of (layer, kv_head) by the gate's granularity; false when nothing was left.
  bool repair(cache::KvStore::Reader& reader, int layer, int kv_head, const float* q, int group, std::int64_t n_ctx,
              const Group& g) const;

  KvGeometry g_;
  CertifiedOptions opts_;
  mutable cache::KvStore store_;  // promotions (repairs) happen inside attend
  double delta_loc_;
  mutable std::mutex mu_;
  mutable std::vector<MeterCell> cells_;
};

}  // namespace witcert::attn
