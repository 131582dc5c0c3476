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
  if (opts.gate.tau < 0.0 || std::isnan(opts.gate.tau))
    throw std::invalid_argument("the gate threshold tau must be positive");
}

struct CertifiedKvCache::Group {
  std::vector<HeadPartial> partials;
  std::vector<HeadResult> results;
  std::vector<float> out;
};

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

AttendConcurrency CertifiedKvCache::attend_concurrency() const {
  if (!opts_.gate.on()) return AttendConcurrency::any;
  return opts_.gate.granularity == Granularity::request ? AttendConcurrency::serial : AttendConcurrency::per_head;
}

std::vector<MeterCell> CertifiedKvCache::cells() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cells_;
}

void CertifiedKvCache::compute(cache::KvStore::Reader& reader, const float* q, int group, std::int64_t n_ctx,
                               Group& g) const {
  const int d = g_.head_dim;
  const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), n_ctx, delta_loc_};
  // Split-KV over page-aligned ranges; partials merge under the LSE weights.
  const std::int64_t page = store_.config().page_size;
  const std::int64_t pages = (n_ctx + page - 1) / page;
  g.partials.assign(group, HeadPartial{});
  std::vector<HeadPartial> part;
  for (int s = 0; s < opts_.splits; ++s) {
    const std::int64_t b = std::min(n_ctx, pages * s / opts_.splits * page);
    const std::int64_t e = std::min(n_ctx, pages * (s + 1) / opts_.splits * page);
    if (b >= e) continue;
    part.assign(group, HeadPartial{});
    attend_range_fast(reader, q, group, d, b, e, ctx, part);
    for (int h = 0; h < group; ++h) g.partials[h].merge(part[h]);
  }
  finish_group(g);
}

void CertifiedKvCache::finish_group(Group& g) const {
  const int d = g_.head_dim;
  const std::size_t group = g.partials.size();
  g.out.resize(group * d);
  g.results.resize(group);
  for (std::size_t h = 0; h < group; ++h) g.results[h] = finish(g.partials[h], d, &g.out[h * d]);
}

bool CertifiedKvCache::triggered(const Group& g) const {
  const GateOptions& gate = opts_.gate;
  if (!gate.on()) return false;
  for (const HeadResult& r : g.results)  // any-of-G over the query heads of the KV head
    if (gate.certified() ? r.meter > gate.tau : !(r.eform_raw <= gate.tau)) return true;
  return false;
}

bool CertifiedKvCache::repair(cache::KvStore::Reader& reader, int layer, int kv_head, const float* q, int group,
                              std::int64_t n_ctx, const Group& g) const {
  const std::int64_t page = store_.config().page_size;
  const std::int64_t pages = (n_ctx + page - 1) / page;
  std::vector<std::int64_t> order;
  for (std::int64_t j = 0; j < pages; ++j)
    if (!store_.promoted(layer, kv_head, j)) order.push_back(j);
  if (order.empty()) return false;
  if (opts_.gate.granularity == Granularity::request) {
    for (int l = 0; l < g_.layers; ++l)
      for (int h = 0; h < g_.kv_heads; ++h)
        for (std::int64_t j = 0; j < (store_.length(l, h) + page - 1) / page; ++j) store_.promote(l, h, j);
    return true;
  }
  if (opts_.gate.granularity == Granularity::block) {
    // Plan with p̃ held fixed: take pages by decreasing term of A until every head's
    // ½(A² − 1) would be within τ (τ is on the raw score when risk-ranked, on the meter otherwise).
    std::vector<double> lse_z(group), A(group);
    for (int h = 0; h < group; ++h) {
      lse_z[h] = g.partials[h].meter.z.value();
      A[h] = std::exp(g.partials[h].meter.log_A());
    }
    const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(g_.head_dim)), n_ctx, delta_loc_};
    const std::vector<std::vector<double>> term = page_contributions(reader, q, group, g_.head_dim, n_ctx, ctx, lse_z);
    auto total = [&](std::int64_t j) {
      double t = 0.0;
      for (int h = 0; h < group; ++h) t += term[h][j];
      return t;
    };
    const bool finite = std::all_of(A.begin(), A.end(), [](double a) { return std::isfinite(a); }) &&
                        std::all_of(order.begin(), order.end(), [&](std::int64_t j) { return std::isfinite(total(j)); });
    if (finite) {
      std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return total(a) > total(b); });
      const double target = std::sqrt(1.0 + 2.0 * opts_.gate.tau);  // ½(A² − 1) ≤ τ
      std::size_t take = 0;
      while (take < order.size() && std::any_of(A.begin(), A.end(), [&](double a) { return a > target; })) {
        for (int h = 0; h < group; ++h) A[h] -= term[h][order[take]];
        ++take;
      }
      order.resize(std::max<std::size_t>(take, 1));
    }
  }
  for (std::int64_t j : order) store_.promote(layer, kv_head, j);
  return true;
}

void CertifiedKvCache::serve(cache::KvStore::Reader& reader, int layer, int kv_head, const float* q, int group,
                             std::int64_t n_ctx, Group& g, float* out, std::vector<MeterCell>& cells) const {
  const int d = g_.head_dim;
  std::vector<double> raw_before(group);
  for (int h = 0; h < group; ++h) raw_before[h] = g.results[h].eform_raw;
  bool repaired = false;
  // Repair and recompute the step until the gate is satisfied (every page exact at worst).
  while (triggered(g) && repair(reader, layer, kv_head, q, group, n_ctx, g)) {
    repaired = true;
    compute(reader, q, group, n_ctx, g);
  }
  std::copy(g.out.begin(), g.out.end(), out);
  for (int h = 0; h < group; ++h) {
    const HeadResult& r = g.results[h];
    const double tv = opts_.check_soundness ? true_tv(reader, q + h * d, d, n_ctx) : NAN;
    cells.push_back({layer, kv_head * group + h, n_ctx - 1, r.eform_raw, r.meter, r.v_meter, tv, raw_before[h],
                     repaired});
  }
}

void CertifiedKvCache::log(const std::vector<MeterCell>& cells) const {
  if (opts_.sink) opts_.sink->record(cells);
  if (!opts_.keep_cells) return;
  std::lock_guard<std::mutex> lock(mu_);
  cells_.insert(cells_.end(), cells.begin(), cells.end());
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
      local.push_back({layer, kv_head * group + h, n_ctx - 1, 0.0, 0.0, 0.0, opts_.check_soundness ? 0.0 : NAN, 0.0,
                       false});
  } else {
    Group g;
    compute(reader, q, group, n_ctx, g);
    serve(reader, layer, kv_head, q, group, n_ctx, g, out, local);
  }
  log(local);
}

void CertifiedKvCache::attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group,
                                     std::int64_t pos0, std::int64_t n, float* out, std::int64_t out_stride) const {
  if (exact() || n == 1) {
    KvCache::attend_causal(layer, kv_head, q, q_stride, group, pos0, n, out, out_stride);
    return;
  }
  const int d = g_.head_dim;
  const std::size_t row = static_cast<std::size_t>(group) * d;
  cache::KvStore::Reader reader(store_, layer, kv_head);
  // The run's n·group queries as one block, so that every page of the shared prefix [0, pos0) is
  // read and decoded once for all of them. Every query of the run takes the union bound over
  // the run's longest context, S = pos0 + n: u_t grows with S, so it stays an upper bound for
  // each query (the per-position path takes S = its own n_ctx).
  std::vector<float> qs(n * row);
  for (std::int64_t i = 0; i < n; ++i) std::copy(q + i * q_stride, q + i * q_stride + row, &qs[i * row]);
  const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), pos0 + n, delta_loc_};
  std::vector<HeadPartial> prefix(static_cast<std::size_t>(n) * group), tail;
  if (pos0 > 0) attend_range_fast(reader, qs.data(), static_cast<int>(n * group), d, 0, pos0, ctx, prefix);
  std::vector<MeterCell> local;
  for (std::int64_t i = 0; i < n; ++i) {
    // The causal tail [pos0, pos0 + i] is this query's own.
    tail.assign(group, HeadPartial{});
    attend_range_fast(reader, &qs[i * row], group, d, pos0, pos0 + i + 1, ctx, tail);
    Group g;
    g.partials.assign(prefix.begin() + i * group, prefix.begin() + (i + 1) * group);
    for (int h = 0; h < group; ++h) g.partials[h].merge(tail[h]);
    finish_group(g);
    serve(reader, layer, kv_head, &qs[i * row], group, pos0 + i + 1, g, out + i * out_stride, local);
  }
  log(local);
}

}  // namespace witcert::attn
