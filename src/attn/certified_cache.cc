#include "attn/certified_cache.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "attn/certified_attention.h"
#include "attn/certified_attention_fast.h"
#include "attn/exact_attention_fast.h"
#include "cert/subgaussian.h"

namespace witcert::attn {

CertifiedKvCache::CertifiedKvCache(const cache::CacheConfig& cfg, const CertifiedOptions& opts)
    : g_{cfg.layers, cfg.kv_heads, cfg.head_dim, cfg.capacity},
      opts_(opts),
      store_(cfg),
      delta_loc_(cert::delta_loc(opts.delta_req, cfg.layers, opts.q_heads, opts.decode_budget)) {
  if (opts.splits < 1) throw std::invalid_argument("split-KV partitions must be at least 1");
}

bool CertifiedKvCache::exact() const {
  return store_.kind(quant::KvSide::key) == cache::FormatKind::exact &&
         store_.kind(quant::KvSide::value) == cache::FormatKind::exact;
}

void CertifiedKvCache::write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) {
  store_.write(layer, kv_head, pos, k, v);
}

void CertifiedKvCache::clear() {
  store_.clear();
  std::lock_guard<std::mutex> lock(mu_);
  cells_.clear();
}

std::vector<MeterCell> CertifiedKvCache::cells() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cells_;
}

void CertifiedKvCache::attend(int layer, int kv_head, const float* q, int group, std::int64_t n_ctx,
                              float* out) const {
  const int d = g_.head_dim;
  cache::KvStore::Reader reader(store_, layer, kv_head);
  std::vector<MeterCell> local;
  if (exact()) {
    // Zero intrusion: bit for bit the computation of the plain exact cache, meter 0.
    std::vector<const f16*> keys(n_ctx), values(n_ctx);
    for (std::int64_t t = 0; t < n_ctx; ++t) {
      keys[t] = reader.exact_key_row(t);
      values[t] = reader.exact_value_row(t);
    }
    exact_attention_group(q, group, keys.data(), values.data(), n_ctx, d, out);
    for (int h = 0; h < group; ++h)
      local.push_back({layer, kv_head * group + h, n_ctx - 1, 0.0, 0.0, 0.0, opts_.check_soundness ? 0.0 : NAN});
  } else {
    const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), n_ctx, delta_loc_};
    // Split-KV over page-aligned ranges; partials merge under the LSE weights.
    const std::int64_t page = store_.config().page_size;
    const std::int64_t pages = (n_ctx + page - 1) / page;
    std::vector<HeadPartial> merged(group), part;
    for (int s = 0; s < opts_.splits; ++s) {
      const std::int64_t b = std::min(n_ctx, pages * s / opts_.splits * page);
      const std::int64_t e = std::min(n_ctx, pages * (s + 1) / opts_.splits * page);
      if (b >= e) continue;
      part.assign(group, HeadPartial{});
      attend_range_fast(reader, q, group, d, b, e, ctx, part);
      for (int h = 0; h < group; ++h) merged[h].merge(part[h]);
    }
    for (int h = 0; h < group; ++h) {
      const HeadResult r = finish(merged[h], d, out + h * d);
      const double tv = opts_.check_soundness ? true_tv(reader, q + h * d, d, n_ctx) : NAN;
      local.push_back({layer, kv_head * group + h, n_ctx - 1, r.eform_raw, r.meter, r.v_meter, tv});
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  cells_.insert(cells_.end(), local.begin(), local.end());
}

}  // namespace witcert::attn
