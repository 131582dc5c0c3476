#include "gate/certified_cache.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/cpu/attend.h"
#include "attention/cpu/exact_attention_fast.h"
#include "attention/reference/certified_attention.h"
#include "cert/subgaussian.h"
#include "gate/repair_plan.h"

namespace witcert::gate {

using attention::HeadPartial;
using attention::HeadResult;
namespace {

// The store's settings with the exact tier kept where the gate or the soundness check reads it.
kvcache::CacheConfig with_tier(kvcache::CacheConfig cfg, const CertifiedOptions& opts) {
  cfg.exact_tier = cfg.exact_tier || opts.gate.on() || opts.check_soundness;
  return cfg;
}

}  // namespace

CertifiedKvCache::CertifiedKvCache(const kvcache::CacheConfig& cfg, const CertifiedOptions& opts)
    : CertifiedKvCache(std::make_shared<kvcache::KvPool>(with_tier(cfg, opts)), opts) {}

CertifiedKvCache::CertifiedKvCache(std::shared_ptr<kvcache::KvPool> pool, const CertifiedOptions& opts)
    : opts_(opts), store_(std::move(pool)) {
  const kvcache::CacheConfig& cfg = store_.config();
  g_ = {cfg.layers, cfg.kv_heads, cfg.head_dim, cfg.capacity};
  // δ_req goes to the Tier-B sides, halved between keys and values when both are Tier B, and each
  // side's share to its cells by a union bound (δ_loc = share/(L·H·T)).
  const double share = store_.key_dither() && store_.value_dither() ? 0.5 : 1.0;
  delta_loc_ = cert::delta_loc(opts.delta_req * share, cfg.layers, opts.q_heads, opts.decode_budget);
  delta_v_loc_ = store_.value_dither() ? delta_loc_ : 0.0;
  if (opts.splits < 1) throw std::invalid_argument("split-KV partitions must be at least 1");
  opts.gate.validate();
  if ((opts.gate.on() || opts.check_soundness) && !store_.has_exact_tier())
    throw std::invalid_argument("the gate and the soundness check read the exact backing tier, and this pool keeps none");
}

attention::BoundContext CertifiedKvCache::context(std::int64_t S) const {
  return {1.0 / std::sqrt(static_cast<double>(g_.head_dim)), S, delta_loc_};
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

struct CertifiedKvCache::Scratch {
  kernel::Workspace work;  // the kernel's buffers
  Group group;
  std::vector<HeadPartial> part;
  std::vector<HeadResult> before;
  std::vector<MeterCell> cells;
  std::vector<const f16*> keys, values;
};

CertifiedKvCache::Scratch& CertifiedKvCache::scratch() {
  thread_local Scratch s;
  return s;
}

void CertifiedKvCache::write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) {
  store_.write(layer, kv_head, pos, k, v);
}

void CertifiedKvCache::clear() { store_.clear(); }

bool CertifiedKvCache::share_prefix(const kvcache::KvCache& donor, std::int64_t n) {
  const auto* d = dynamic_cast<const CertifiedKvCache*>(&donor);
  if (d == nullptr || d->store_.shared_pool() != store_.shared_pool()) return false;
  if (opts_.check_soundness) return false;
  if ((opts_.gate.on() || d->opts_.gate.on()) && !same_repairs(*d)) return false;
  return store_.share_prefix(d->store_, n);
}

bool CertifiedKvCache::same_repairs(const CertifiedKvCache& other) const {
  const CertifiedOptions& o = other.opts_;
  if (opts_.gate != o.gate || opts_.bound != o.bound || opts_.splits != o.splits || opts_.q_heads != o.q_heads) return false;
  // Tier B's radius u_t reads δ_loc = δ_req/(L·H·T); Tier A's bounds do not.
  if (delta_v_loc_ != other.delta_v_loc_) return false;
  return store_.kind(formats::KvSide::key) != kvcache::FormatKind::dither || delta_loc_ == other.delta_loc_;
}

kvcache::AttendConcurrency CertifiedKvCache::attend_concurrency() const {
  if (!opts_.gate.on()) return kvcache::AttendConcurrency::any;
  return opts_.gate.granularity == Granularity::request ? kvcache::AttendConcurrency::serial
                                                        : kvcache::AttendConcurrency::per_head;
}

void CertifiedKvCache::compute_step(kvcache::KvStore::Reader& reader, const float* q, int group, std::int64_t begin,
                                    std::int64_t end, Group& g) {
  if (!reader.served_exact(begin, end)) {
    compute(reader, q, group, begin, end, g);
    return;
  }
  // Every token exact (a fully repaired head): bit for bit the plain exact cache's output, meter 0.
  const int d = g_.head_dim;
  std::vector<const f16*>& keys = scratch().keys;
  std::vector<const f16*>& values = scratch().values;
  keys.resize(end - begin);
  values.resize(end - begin);
  for (std::int64_t t = begin; t < end; ++t) {
    keys[t - begin] = reader.exact_key_row(t);
    values[t - begin] = reader.exact_value_row(t);
  }
  g.out.resize(static_cast<std::size_t>(group) * d);
  attention::exact_attention_group(q, group, keys.data(), values.data(), end - begin, d, g.out.data());
  g.partials.assign(group, HeadPartial{});
  g.results.assign(group, HeadResult{});
}

void CertifiedKvCache::compute(kvcache::KvStore::Reader& reader, const float* q, int group, std::int64_t begin,
                               std::int64_t end, Group& g) {
  const int d = g_.head_dim;
  const attention::BoundContext ctx = context(end - begin);
  // Split-KV over page-aligned ranges; partials merge under the LSE weights.
  const std::int64_t page = store_.config().page_size;
  const std::int64_t first = begin / page, pages = (end + page - 1) / page - first;
  g.partials.assign(group, HeadPartial{});
  std::vector<HeadPartial>& part = scratch().part;
  kernel::Workspace& work = scratch().work;
  for (int s = 0; s < opts_.splits; ++s) {
    const std::int64_t b = std::clamp((first + pages * s / opts_.splits) * page, begin, end);
    const std::int64_t e = std::clamp((first + pages * (s + 1) / opts_.splits) * page, begin, end);
    if (b >= e) continue;
    part.assign(group, HeadPartial{});
    kernel::attend_range(work, reader, q, group, d, b, e, ctx, part);
    for (int h = 0; h < group; ++h) g.partials[h].merge(part[h]);
  }
  finish_group(reader, q, begin, end, g);
}

void CertifiedKvCache::finish_group(kvcache::KvStore::Reader& reader, const float* q, std::int64_t begin,
                                    std::int64_t end, Group& g) {
  const int d = g_.head_dim;
  const std::size_t group = g.partials.size();
  g.out.resize(group * d);
  g.results.resize(group);
  for (std::size_t h = 0; h < group; ++h) g.results[h] = attention::finish(g.partials[h], d, &g.out[h * d], opts_.bound, delta_v_loc_);
  if (opts_.bound != cert::BoundShape::retention) return;
  const std::vector<double> retention =
      attention::retention_raw(reader, q, static_cast<int>(group), d, begin, end, context(end - begin));
  for (std::size_t h = 0; h < group; ++h)
    g.results[h].meter = std::min(g.results[h].meter, cert::clamp_meter(retention[h]));  // both sound
}

bool CertifiedKvCache::repair(kvcache::KvStore::Reader& reader, int layer, int kv_head, const float* q,
                              std::int64_t begin, std::int64_t end, const Group& g) {
  const std::int64_t page = store_.config().page_size;
  std::vector<std::int64_t> order;
  for (std::int64_t j = begin / page; j < (end + page - 1) / page; ++j)
    if (!store_.promoted(layer, kv_head, j)) order.push_back(j);
  if (order.empty()) return false;
  const std::int64_t at = end - 1;  // the position whose attention asks for the repair
  if (opts_.gate.granularity == Granularity::request) {
    promote_all(at);
    return true;
  }
  if (opts_.gate.granularity == Granularity::block)
    plan_blocks(reader, q, g_.head_dim, begin, end, context(end - begin), opts_.gate, g.partials, g.results, order);
  for (std::int64_t j : order) store_.promote(layer, kv_head, j, at);
  return true;
}

std::int64_t CertifiedKvCache::promote_all(std::int64_t at) {
  if (!opts_.gate.on()) throw std::logic_error("promote_all: the cache has no gate, so no exact tier to serve");
  const std::int64_t page = store_.config().page_size;
  std::int64_t promoted = 0;
  for (int l = 0; l < g_.layers; ++l)
    for (int h = 0; h < g_.kv_heads; ++h)
      for (std::int64_t j = 0; j < (store_.length(l, h) + page - 1) / page; ++j) promoted += store_.promote(l, h, j, at);
  return promoted;
}

bool CertifiedKvCache::serve(kvcache::KvStore::Reader& reader, int layer, int kv_head, const float* q, int group,
                             std::int64_t begin, std::int64_t end, Group& g, float* out, std::vector<MeterCell>& cells) {
  const int d = g_.head_dim;
  std::vector<HeadResult>& before = scratch().before;  // the step's results before its repair
  if (opts_.gate.on()) before = g.results;
  bool repaired = false;
  // Repair and recompute the step until the gate is satisfied (every page exact at worst).
  while (opts_.gate.triggered(g.results) && repair(reader, layer, kv_head, q, begin, end, g)) {
    repaired = true;
    compute_step(reader, q, group, begin, end, g);
  }
  std::copy(g.out.begin(), g.out.end(), out);
  for (int h = 0; h < group; ++h) {
    const HeadResult& r = g.results[h];
    const HeadResult& b = repaired ? before[h] : r;
    attention::TrueErrors truth{NAN, NAN};
    if (opts_.check_soundness) truth = attention::true_errors(reader, q + h * d, d, begin, end);
    // In the V meter's unit; an error of 0 stays 0 where max‖v‖ is 0, and NaN (unchecked) NaN.
    const double v_true = truth.value_error > 0.0 ? truth.value_error / g.partials[h].v_max : truth.value_error;
    cells.push_back({layer, kv_head * group + h, end - 1, r.eform_raw, r.meter, r.v_meter, truth.tv, b.eform_raw, b.meter,
                     b.v_meter, repaired, r.output_bound, v_true, r.v_meter_sure});
  }
  return repaired;
}

void CertifiedKvCache::log(const std::vector<MeterCell>& cells) {
  for (MeterSink* sink : opts_.sinks) sink->record(cells);
}

void CertifiedKvCache::attend(int layer, int kv_head, const float* q, int group, std::int64_t begin, std::int64_t end,
                              float* out) {
  kvcache::KvStore::Reader reader(store_, layer, kv_head);
  Scratch& s = scratch();
  s.cells.clear();
  compute_step(reader, q, group, begin, end, s.group);
  serve(reader, layer, kv_head, q, group, begin, end, s.group, out, s.cells);
  log(s.cells);
}

void CertifiedKvCache::attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group,
                                     std::int64_t pos0, std::int64_t n, std::int64_t window, float* out,
                                     std::int64_t out_stride) {
  kvcache::KvStore::Reader reader(store_, layer, kv_head);
  if (n == 1 || reader.served_exact(kvcache::window_begin(pos0, window), pos0 + n)) {
    // One position, or the plain exact path for each.
    KvCache::attend_causal(layer, kv_head, q, q_stride, group, pos0, n, window, out, out_stride);
    return;
  }
  const int d = g_.head_dim;
  const std::size_t row = static_cast<std::size_t>(group) * d;
  // The run's n·group queries as one block over the positions before the run that every one of
  // them attends, [shared, pos0) with `shared` the last query's first position, so that every page
  // there is read and decoded once for all of them. Every query of the run takes the union bound
  // over the run's widest span S: u_t grows with S, so it stays an upper bound for each query (the
  // per-position path takes S = its own span).
  std::vector<float> qs(n * row);
  for (std::int64_t i = 0; i < n; ++i) std::copy(q + i * q_stride, q + i * q_stride + row, &qs[i * row]);
  const std::int64_t shared = kvcache::window_begin(pos0 + n - 1, window);
  const attention::BoundContext ctx = context(window > 0 ? std::min(window, pos0 + n) : pos0 + n);
  std::vector<HeadPartial> prefix(static_cast<std::size_t>(n) * group), own;
  if (shared < pos0)
    kernel::attend_range(scratch().work, reader, qs.data(), static_cast<int>(n * group), d, shared, pos0, ctx, prefix);
  std::vector<MeterCell> local;
  // A repair promotes pages that the shared prefix may have read packed: the positions after it
  // compute their whole span afresh, so that the gate sees what they are served.
  bool prefix_stale = false;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t begin = kvcache::window_begin(pos0 + i, window), end = pos0 + i + 1;
    const bool from_prefix = shared < pos0 && !prefix_stale;
    Group g;
    if (from_prefix)
      g.partials.assign(prefix.begin() + i * group, prefix.begin() + (i + 1) * group);
    else
      g.partials.assign(group, HeadPartial{});
    // The query's own positions: those before the shared range, and the causal tail from pos0 (or
    // its whole span where nothing is shared).
    const auto add = [&](std::int64_t b, std::int64_t e) {
      if (b >= e) return;
      own.assign(group, HeadPartial{});
      kernel::attend_range(scratch().work, reader, &qs[i * row], group, d, b, e, ctx, own);
      for (int h = 0; h < group; ++h) g.partials[h].merge(own[h]);
    };
    if (from_prefix) {
      add(begin, shared);
      add(pos0, end);
    } else {
      add(begin, end);
    }
    finish_group(reader, &qs[i * row], begin, end, g);
    if (serve(reader, layer, kv_head, &qs[i * row], group, begin, end, g, out + i * out_stride, local)) prefix_stale = true;
  }
  log(local);
}

}  // namespace witcert::gate
