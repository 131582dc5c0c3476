#include "attn/certified_cache.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "attn/certified_attention.h"
#include "attn/exact_attention_fast.h"
#include "cert/subgaussian.h"
#include "kernel/attend.h"

namespace witcert::attn {
namespace {

// The kernel's buffers: one per thread, since attend runs on several threads at once.
kernel::Workspace& workspace() {
  thread_local kernel::Workspace work;
  return work;
}

// The store's settings with the exact tier kept where the gate or the soundness check reads it.
cache::CacheConfig with_tier(cache::CacheConfig cfg, const CertifiedOptions& opts) {
  cfg.exact_tier = cfg.exact_tier || opts.gate.on() || opts.check_soundness;
  return cfg;
}

}  // namespace

const char* granularity_name(Granularity g) {
  switch (g) {
    case Granularity::head: return "head";
    case Granularity::block: return "block";
    case Granularity::request: return "request";
  }
  return "?";
}

Granularity parse_granularity(std::string_view name) {
  for (Granularity g : {Granularity::head, Granularity::block, Granularity::request})
    if (name == granularity_name(g)) return g;
  throw std::invalid_argument("--granularity must be head, block or request, got '" + std::string(name) + "'");
}

CertifiedKvCache::CertifiedKvCache(const cache::CacheConfig& cfg, const CertifiedOptions& opts)
    : g_{cfg.layers, cfg.kv_heads, cfg.head_dim, cfg.capacity},
      opts_(opts),
      store_(with_tier(cfg, opts)),
      delta_loc_(cert::delta_loc(opts.delta_req, cfg.layers, opts.q_heads, opts.decode_budget)) {
  if (opts.splits < 1) throw std::invalid_argument("split-KV partitions must be at least 1");
  if (!(opts.gate.tau >= 0.0) || std::isinf(opts.gate.tau))
    throw std::invalid_argument("the gate threshold tau must be finite and positive");
  if (opts.gate.on() && !(opts.gate.tau_v > 0.0 && std::isfinite(opts.gate.tau_v)))
    throw std::invalid_argument("the gate threshold tau_v must be finite and positive");
}

void CertifiedKvCache::set_check_soundness(bool on) {
  if (on && !store_.has_exact_tier())
    throw std::logic_error("the soundness check reads the exact backing tier: build the cache with check_soundness");
  opts_.check_soundness = on;
}

struct CertifiedKvCache::Group {
  std::vector<HeadPartial> partials;
  std::vector<HeadResult> results;
  std::vector<float> out;
};

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

void CertifiedKvCache::compute_step(cache::KvStore::Reader& reader, const float* q, int group, std::int64_t n_ctx,
                                    Group& g) const {
  if (!reader.served_exact(n_ctx)) {
    compute(reader, q, group, n_ctx, g);
    return;
  }
  // Every token exact (a fully repaired head): bit for bit the plain exact cache's output, meter 0.
  const int d = g_.head_dim;
  std::vector<const f16*> keys(n_ctx), values(n_ctx);
  for (std::int64_t t = 0; t < n_ctx; ++t) {
    keys[t] = reader.exact_key_row(t);
    values[t] = reader.exact_value_row(t);
  }
  g.out.resize(static_cast<std::size_t>(group) * d);
  exact_attention_group(q, group, keys.data(), values.data(), n_ctx, d, g.out.data());
  g.partials.assign(group, HeadPartial{});
  g.results.assign(group, HeadResult{});
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
    kernel::attend_range(workspace(), reader, q, group, d, b, e, ctx, part);
    for (int h = 0; h < group; ++h) g.partials[h].merge(part[h]);
  }
  finish_group(reader, q, n_ctx, g);
}

void CertifiedKvCache::finish_group(cache::KvStore::Reader& reader, const float* q, std::int64_t n_ctx,
                                    Group& g) const {
  const int d = g_.head_dim;
  const std::size_t group = g.partials.size();
  g.out.resize(group * d);
  g.results.resize(group);
  for (std::size_t h = 0; h < group; ++h) g.results[h] = finish(g.partials[h], d, &g.out[h * d], opts_.bound);
  if (opts_.bound != cert::BoundShape::retention) return;
  const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), n_ctx, delta_loc_};
  const std::vector<double> retention = retention_raw(reader, q, static_cast<int>(group), d, n_ctx, ctx);
  for (std::size_t h = 0; h < group; ++h)
    g.results[h].meter = std::min(g.results[h].meter, cert::clamp_meter(retention[h]));  // both sound
}

bool CertifiedKvCache::pass_k(const HeadResult& r) const {
  return opts_.gate.certified() ? r.meter <= opts_.gate.tau : r.eform_raw <= opts_.gate.tau;
}

bool CertifiedKvCache::pass_v(const HeadResult& r) const { return r.v_meter <= opts_.gate.tau_v; }

bool CertifiedKvCache::triggered(const Group& g) const {
  if (!opts_.gate.on()) return false;
  for (const HeadResult& r : g.results)  // any-of-G over the query heads of the KV head
    if (!pass_k(r) || !pass_v(r)) return true;
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
  if (opts_.gate.granularity == Granularity::block) plan_blocks(reader, q, group, n_ctx, g, order);
  for (std::int64_t j : order) store_.promote(layer, kv_head, j);
  return true;
}

bool CertifiedKvCache::plan_blocks(cache::KvStore::Reader& reader, const float* q, int group, std::int64_t n_ctx,
                                   const Group& g, std::vector<std::int64_t>& order) const {
  // Plan with p̃ held fixed. K: take pages by decreasing term of A until every head's
  // ½(A² − 1) would be within τ_K (on the raw score when risk-ranked, on the meter otherwise).
  // V: then pages by decreasing term of Σ p̃_t ρ^v_t until every head's V meter would be within
  // τ_V. A page taken for one side lowers the other's sum too.
  std::vector<double> lse_z(group), A(group), rho(group);
  for (int h = 0; h < group; ++h) {
    lse_z[h] = g.partials[h].meter.z.value();
    A[h] = std::exp(g.partials[h].meter.log_A());
    // The V meter times max‖v‖: Σ p̃ ρ^v with its float allowance, the quantity the pages' terms add up to.
    rho[h] = g.results[h].v_meter * g.partials[h].v_max;
  }
  const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(g_.head_dim)), n_ctx, delta_loc_};
  const PageTerms terms = page_contributions(reader, q, group, g_.head_dim, n_ctx, ctx, lse_z);
  const auto total = [group](const std::vector<std::vector<double>>& t, std::int64_t j) {
    double s = 0.0;
    for (int h = 0; h < group; ++h) s += t[h][j];
    return s;
  };
  const auto all_finite = [&](const std::vector<double>& per_head, const std::vector<std::vector<double>>& t) {
    return std::all_of(per_head.begin(), per_head.end(), [](double a) { return std::isfinite(a); }) &&
           std::all_of(order.begin(), order.end(), [&](std::int64_t j) { return std::isfinite(total(t, j)); });
  };
  if (!all_finite(A, terms.a) || !all_finite(rho, terms.rho)) return false;  // no plan: every page
  const double a_target = std::sqrt(1.0 + 2.0 * opts_.gate.tau);  // ½(A² − 1) ≤ τ_K
  const auto k_pending = [&] { return std::any_of(A.begin(), A.end(), [&](double a) { return a > a_target; }); };
  const auto v_pending = [&] {
    for (int h = 0; h < group; ++h)
      if (rho[h] > opts_.gate.tau_v * g.partials[h].v_max) return true;
    return false;
  };
  std::vector<std::int64_t> left = order, plan;
  const auto take = [&](const std::vector<std::vector<double>>& t, const auto& pending) {
    std::stable_sort(left.begin(), left.end(), [&](std::int64_t a, std::int64_t b) { return total(t, a) > total(t, b); });
    std::size_t n = 0;
    for (; n < left.size() && pending(); ++n) {
      for (int h = 0; h < group; ++h) {
        A[h] -= terms.a[h][left[n]];
        rho[h] -= terms.rho[h][left[n]];
      }
      plan.push_back(left[n]);
    }
    left.erase(left.begin(), left.begin() + static_cast<std::ptrdiff_t>(n));
  };
  take(terms.a, k_pending);
  take(terms.rho, v_pending);
  if (plan.empty()) plan.push_back(left.front());  // rounding left the plan short: at least one page a round
  order = plan;
  return true;
}

void CertifiedKvCache::serve(cache::KvStore::Reader& reader, int layer, int kv_head, const float* q, int group,
                             std::int64_t n_ctx, Group& g, float* out, std::vector<MeterCell>& cells) const {
  const int d = g_.head_dim;
  std::vector<HeadResult> before;  // the step's results before its repair; only a gate changes them
  if (opts_.gate.on()) before = g.results;
  bool repaired = false;
  // Repair and recompute the step until the gate is satisfied (every page exact at worst).
  while (triggered(g) && repair(reader, layer, kv_head, q, group, n_ctx, g)) {
    repaired = true;
    compute_step(reader, q, group, n_ctx, g);
  }
  std::copy(g.out.begin(), g.out.end(), out);
  for (int h = 0; h < group; ++h) {
    const HeadResult& r = g.results[h];
    const HeadResult& b = repaired ? before[h] : r;
    const double tv = opts_.check_soundness ? true_tv(reader, q + h * d, d, n_ctx) : NAN;
    cells.push_back({layer, kv_head * group + h, n_ctx - 1, r.eform_raw, r.meter, r.v_meter, tv, b.eform_raw, b.meter,
                     b.v_meter, repaired});
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
  cache::KvStore::Reader reader(store_, layer, kv_head);
  std::vector<MeterCell> local;
  Group g;
  compute_step(reader, q, group, n_ctx, g);
  serve(reader, layer, kv_head, q, group, n_ctx, g, out, local);
  log(local);
}

void CertifiedKvCache::attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group,
                                     std::int64_t pos0, std::int64_t n, float* out, std::int64_t out_stride) const {
  cache::KvStore::Reader reader(store_, layer, kv_head);
  if (n == 1 || reader.served_exact(pos0 + n)) {  // one position, or the plain exact path for each
    KvCache::attend_causal(layer, kv_head, q, q_stride, group, pos0, n, out, out_stride);
    return;
  }
  const int d = g_.head_dim;
  const std::size_t row = static_cast<std::size_t>(group) * d;
  // The run's n·group queries as one block, so that every page of the shared prefix [0, pos0) is
  // read and decoded once for all of them. Every query of the run takes the union bound over
  // the run's longest context, S = pos0 + n: u_t grows with S, so it stays an upper bound for
  // each query (the per-position path takes S = its own n_ctx).
  std::vector<float> qs(n * row);
  for (std::int64_t i = 0; i < n; ++i) std::copy(q + i * q_stride, q + i * q_stride + row, &qs[i * row]);
  const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), pos0 + n, delta_loc_};
  std::vector<HeadPartial> prefix(static_cast<std::size_t>(n) * group), tail;
  if (pos0 > 0) kernel::attend_range(workspace(), reader, qs.data(), static_cast<int>(n * group), d, 0, pos0, ctx, prefix);
  std::vector<MeterCell> local;
  for (std::int64_t i = 0; i < n; ++i) {
    // The causal tail [pos0, pos0 + i] is this query's own.
    tail.assign(group, HeadPartial{});
    kernel::attend_range(workspace(), reader, &qs[i * row], group, d, pos0, pos0 + i + 1, ctx, tail);
    Group g;
    g.partials.assign(prefix.begin() + i * group, prefix.begin() + (i + 1) * group);
    for (int h = 0; h < group; ++h) g.partials[h].merge(tail[h]);
    finish_group(reader, &qs[i * row], pos0 + i + 1, g);
    serve(reader, layer, kv_head, &qs[i * row], group, pos0 + i + 1, g, out + i * out_stride, local);
  }
  log(local);
}

}  // namespace witcert::attn
