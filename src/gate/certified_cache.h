// The certified KV cache behind the model's KvCache interface: it composes the store (packed
// formats in a paged pool with an exact backing tier, kvcache/kv_store.h), the attention kernel whose
// output and meter come from one pass, the gate's policy and repair plan, and the sinks that
// receive every (layer, query head, position) meter.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attention/reference/certified_attention.h"
#include "cert/meter.h"
#include "gate/meter_cell.h"
#include "gate/policy.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_store.h"

namespace witcert::gate {

struct CertifiedOptions {
  int q_heads = 1;                  // query heads per layer (H in δ_loc = δ_req/(L·H·T))
  double delta_req = 1e-2;          // request-level failure budget of Tier B
  std::int64_t decode_budget = 256; // T
  int splits = 1;                   // split-KV partitions per attention call, merged under LSE weights
  bool check_soundness = false;     // also compute the true TV of every cell from the exact tier
  cert::BoundShape bound = cert::BoundShape::min;  // the K meter's shape (retention: a second pass)
  Policy gate;
  std::vector<MeterSink*> sinks;    // receive every served cell (not owned; must outlive the cache)
};

class CertifiedKvCache final : public kvcache::KvCache {
 public:
  // Throws std::invalid_argument for an impossible δ or τ, an unknown format or a bad shape. The
  // exact backing tier is allocated only when the gate or the soundness check needs it
  // (cfg.exact_tier is then set to at least ExactTier::ram).
  CertifiedKvCache(const kvcache::CacheConfig& cfg, const CertifiedOptions& opts);
  // A new sequence over a shared pool, with its own options (gate, δ, bound, decode budget, sinks).
  // Throws std::invalid_argument as above, and when the gate or the soundness check needs an exact
  // tier the pool does not keep.
  CertifiedKvCache(std::shared_ptr<kvcache::KvPool> pool, const CertifiedOptions& opts);

  const kvcache::KvGeometry& geometry() const override { return g_; }
  void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) override;
  using kvcache::KvCache::attend;
  void attend(int layer, int kv_head, const float* q, int group, std::int64_t begin, std::int64_t end,
              float* out) override;
  // Reads the positions before pos0 that the run's n positions share once for all of them; the
  // gate then acts on each position as attend does.
  void attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group, std::int64_t pos0,
                     std::int64_t n, std::int64_t window, float* out, std::int64_t out_stride) override;
  void clear() override;
  void set_prompt_length(std::int64_t n) override { store_.set_prompt_length(n); }
  void retire_before(std::int64_t pos) override { store_.retire_before(pos); }
  // Shares [0, n) of a certified cache over the same pool (kvcache::KvStore::share_prefix), with
  // the donor's repairs made while it computed [0, n). A repair changes the outputs and so the
  // keys and values of the layers above it: with a gate on either side, only a donor that repairs
  // as this cache would (same_repairs) gives the pages this sequence would have written. Never
  // for a cache with the soundness check, which checks every cell of its own prefill.
  bool share_prefix(const kvcache::KvCache& donor, std::int64_t n) override;
  // Repairs promote pages that later calls read: per_head when gated by head or block, serial
  // when a repair promotes every head (request granularity).
  kvcache::AttendConcurrency attend_concurrency() const override;

  const kvcache::KvStore& store() const { return store_; }
  // A request-level repair decided elsewhere (the other ranks of a tensor-parallel model, whose
  // heads asked for it): every written page of every layer and KV head is served exact from now on,
  // as this cache's own request-granular repair does, asked for by position `at`. Returns the pages
  // promoted (page-ins). Throws std::logic_error without a gate (no exact tier to read).
  std::int64_t promote_all(std::int64_t at);
  // Turns the true-TV check on or off for the cells that follow (between forward passes, not
  // during one), so that a study can check only the cells it counts. Throws std::logic_error when
  // the cache was built without the exact tier (construct it with check_soundness).
  void set_check_soundness(bool on);

 private:
  struct Group;    // the results of one attention call
  struct Scratch;  // the decode path's buffers, one set per thread, reused by every call
  static Scratch& scratch();
  void compute(kvcache::KvStore::Reader& reader, const float* q, int group, std::int64_t begin, std::int64_t end,
               Group& g);
  // The step's attention over [begin, end) from the stored formats, or the plain exact path when
  // every token there is served exact.
  void compute_step(kvcache::KvStore::Reader& reader, const float* q, int group, std::int64_t begin,
                    std::int64_t end, Group& g);
  // Gates the computed attention of the position end − 1 over [begin, end) (repairing and
  // recomputing while triggered), writes its output and appends its cells. Returns whether it
  // repaired.
  bool serve(kvcache::KvStore::Reader& reader, int layer, int kv_head, const float* q, int group, std::int64_t begin,
             std::int64_t end, Group& g, float* out, std::vector<MeterCell>& cells);
  void log(const std::vector<MeterCell>& cells);
  // Whether `other` makes exactly this cache's repairs from the same queries: the same policy,
  // bound shape, split count, heads and, for Tier-B keys and values, δ_loc.
  bool same_repairs(const CertifiedKvCache& other) const;
  // The output and meters of every head from the group's merged partials (retention: with its
  // second pass).
  void finish_group(kvcache::KvStore::Reader& reader, const float* q, std::int64_t begin, std::int64_t end, Group& g);
  // Promotes pages of (layer, kv_head) by the gate's granularity (head and block: among the pages of
  // [begin, end)); false when nothing was left.
  bool repair(kvcache::KvStore::Reader& reader, int layer, int kv_head, const float* q, std::int64_t begin,
              std::int64_t end, const Group& g);
  attention::BoundContext context(std::int64_t S) const;

  kvcache::KvGeometry g_;
  CertifiedOptions opts_;
  kvcache::KvStore store_;
  double delta_loc_ = 0.0;
  double delta_v_loc_ = 0.0;  // Tier B of dithered values (KvStore::value_dither), else 0
};

}  // namespace witcert::gate
