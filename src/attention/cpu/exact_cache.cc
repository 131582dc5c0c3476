#include "attention/cpu/exact_cache.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/cpu/exact_attention_fast.h"

namespace witcert::attention {

namespace {

std::int64_t checked_pages(const kvcache::KvGeometry& g, int page_size) {
  if (g.layers <= 0 || g.kv_heads <= 0 || g.head_dim <= 0 || g.capacity <= 0)
    throw std::invalid_argument("KV cache geometry must be positive");
  if (page_size <= 0) throw std::invalid_argument("page size must be positive, got " + std::to_string(page_size));
  return (g.capacity + page_size - 1) / page_size;
}

}  // namespace

ExactPool::ExactPool(const kvcache::KvGeometry& g, int page_size, std::int64_t pages)
    : g_(g), pool_(pages > 0 ? pages : checked_pages(g, page_size), page_size) {
  if (pages > 0) checked_pages(g, page_size);  // the geometry's checks
  const std::size_t n = static_cast<std::size_t>(g.layers) * g.kv_heads * pool_.pages() * page_size * g.head_dim;
  k_ = kvcache::ReservedArray<f16>(n);
  v_ = kvcache::ReservedArray<f16>(n);
}

ExactPool::ExactPool(const ExactPool& other)
    : g_(other.g_), pool_(other.pool_), k_(other.k_.size()), v_(other.v_.size()) {
  std::copy(other.k_.data(), other.k_.data() + other.k_.size(), k_.data());
  std::copy(other.v_.data(), other.v_.data() + other.v_.size(), v_.data());
}

ExactKvCache::ExactKvCache(const kvcache::KvGeometry& g, int page_size)
    : pool_(std::make_shared<ExactPool>(g, page_size)), table_(pool_->pool_, g.capacity) {}

ExactKvCache::ExactKvCache(std::shared_ptr<ExactPool> pool)
    : pool_(pool ? std::move(pool) : throw std::invalid_argument("exact KV cache: no pool")),
      table_(pool_->pool_, pool_->g_.capacity) {}

ExactKvCache::ExactKvCache(const ExactKvCache& other)
    : kvcache::KvCache(other), pool_(std::make_shared<ExactPool>(*other.pool_)), table_(other.table_, pool_->pool_) {}

bool ExactKvCache::share_prefix(const kvcache::KvCache& donor, std::int64_t n) {
  const auto* d = dynamic_cast<const ExactKvCache*>(&donor);
  if (d == nullptr || d->pool_ != pool_ || n <= 0 || n % pool_->page_size() != 0 ||
      n > d->table_.positions_mapped() || table_.page_count() != 0)
    return false;
  table_.share_prefix(d->table_, n / pool_->page_size());
  return true;
}

std::size_t ExactKvCache::index(int layer, int kv_head, std::int64_t pos) const {
  const kvcache::KvGeometry& g = pool_->g_;
  const std::size_t slots = static_cast<std::size_t>(pool_->pages()) * pool_->page_size();
  return ((static_cast<std::size_t>(layer) * g.kv_heads + kv_head) * slots + table_.slot(pos)) * g.head_dim;
}

void ExactKvCache::write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) {
  const kvcache::KvGeometry& g = pool_->g_;
  if (pos < 0 || pos >= g.capacity)
    throw std::out_of_range("KV cache position " + std::to_string(pos) + " outside capacity " +
                            std::to_string(g.capacity));
  if (layer < 0 || layer >= g.layers || kv_head < 0 || kv_head >= g.kv_heads)
    throw std::out_of_range("KV cache: no stream for layer " + std::to_string(layer) + ", KV head " +
                            std::to_string(kv_head));
  if (pos >= table_.positions_mapped()) table_.slot_for_write(pos);  // throws when a page is skipped
  f16* kd = &pool_->k_[index(layer, kv_head, pos)];
  f16* vd = &pool_->v_[index(layer, kv_head, pos)];
  for (int i = 0; i < g.head_dim; ++i) {
    kd[i] = fp16_from_float(k[i]);
    vd[i] = fp16_from_float(v[i]);
  }
}

ExactKvCache::Scratch& ExactKvCache::rows(int layer, int kv_head, std::int64_t n) const {
  thread_local Scratch r;
  r.keys.resize(n);
  r.values.resize(n);
  const std::int64_t page = pool_->page_size();
  const int d = pool_->g_.head_dim;
  for (std::int64_t t0 = 0; t0 < n; t0 += page) {  // a page's rows follow one another
    const f16* k = key(layer, kv_head, t0);
    const f16* v = value(layer, kv_head, t0);
    for (std::int64_t t = t0; t < std::min(n, t0 + page); ++t, k += d, v += d) {
      r.keys[t] = k;
      r.values[t] = v;
    }
  }
  return r;
}

void ExactKvCache::attend(int layer, int kv_head, const float* q, int group, std::int64_t n_ctx, float* out) {
  // The SIMD exact path, bit-identical to exact_attention (exact_attention_fast_test.cc).
  Scratch& r = rows(layer, kv_head, n_ctx);
  exact_attention_group(q, group, r.keys.data(), r.values.data(), n_ctx, pool_->g_.head_dim, out, r.work);
}

void ExactKvCache::attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group,
                                 std::int64_t pos0, std::int64_t n, float* out, std::int64_t out_stride) {
  const int d = pool_->g_.head_dim;
  const std::size_t row = static_cast<std::size_t>(group) * d;
  Scratch& r = rows(layer, kv_head, pos0 + n);
  r.queries.resize(n * row);
  r.outputs.resize(n * row);
  r.lengths.resize(n * group);
  for (std::int64_t i = 0; i < n; ++i) {
    std::copy(q + i * q_stride, q + i * q_stride + row, &r.queries[i * row]);
    std::fill_n(&r.lengths[i * group], group, pos0 + i + 1);
  }
  exact_attention_multi(r.queries.data(), static_cast<int>(n * group), r.lengths.data(), r.keys.data(),
                        r.values.data(), d, r.outputs.data(), r.work);
  for (std::int64_t i = 0; i < n; ++i)
    std::copy(&r.outputs[i * row], &r.outputs[(i + 1) * row], out + i * out_stride);
}

}  // namespace witcert::attention
