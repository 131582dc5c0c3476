// The certified KV cache behind the model's KvCache interface: packed formats in a paged pool
// with an exact backing tier (cache/kv_store.h), attention whose output and meter come from one
// pass (attn/certified_attention.h), and a log of every (layer, query head, position) meter.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "attn/kv_cache.h"
#include "cache/kv_store.h"

namespace witcert::attn {

struct CertifiedOptions {
  int q_heads = 1;                  // query heads per layer (H in δ_loc = δ_req/(L·H·T))
  double delta_req = 1e-2;          // request-level failure budget of Tier B
  std::int64_t decode_budget = 256; // T
  int splits = 1;                   // split-KV partitions per attention call, merged under LSE weights
  bool check_soundness = false;     // also compute the true TV of every cell from the exact tier
};

// One (layer, query head, position) cell.
struct MeterCell {
  int layer;
  int q_head;
  std::int64_t pos;     // the query's position; it attends over [0, pos]
  double eform_raw;     // Theorem 1 unclamped: the risk score (+inf: no guarantee)
  double meter;         // min(1, sound K forms)
  double v_meter;
  double tv;            // the true TV (NaN unless check_soundness)
};

class CertifiedKvCache final : public KvCache {
 public:
  // Throws std::invalid_argument for an impossible δ, an unknown format or a bad shape.
  CertifiedKvCache(const cache::CacheConfig& cfg, const CertifiedOptions& opts);

  const KvGeometry& geometry() const override { return g_; }
  void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) override;
  void attend(int layer, int kv_head, const float* q, int group, std::int64_t n_ctx, float* out) const override;
  void clear() override;

  const cache::KvStore& store() const { return store_; }
  // Turns the true-TV check on or off for the cells that follow (between forward passes, not
  // during one), so that a study can check only the cells it counts.
  void set_check_soundness(bool on) { opts_.check_soundness = on; }
  bool exact() const;  // both sides fp16: attention is the plain exact path, the meter 0
  std::vector<MeterCell> cells() const;

 private:
  KvGeometry g_;
  CertifiedOptions opts_;
  cache::KvStore store_;
  double delta_loc_;
  mutable std::mutex mu_;
  mutable std::vector<MeterCell> cells_;
};

}  // namespace witcert::attn
