#include "attention/cpu/exact_cache.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention/cpu/exact_attention_fast.h"

namespace witcert::attention {

namespace {

kvcache::KvGeometry geometry_of(const kvcache::CacheConfig& c) { return {c.layers, c.kv_heads, c.head_dim, c.capacity}; }

const std::shared_ptr<kvcache::KvPool>& fp16_pool(const std::shared_ptr<kvcache::KvPool>& pool) {
  if (!pool) throw std::invalid_argument("exact KV cache: no pool");
  if (pool->kind(formats::KvSide::key) != formats::FormatKind::exact ||
      pool->kind(formats::KvSide::value) != formats::FormatKind::exact)
    throw std::invalid_argument("exact KV cache: the pool's formats are not fp16");
  return pool;
}

}  // namespace

kvcache::CacheConfig exact_config(const kvcache::KvGeometry& g, int page_size, std::int64_t pages,
                                  std::vector<std::int64_t> windows) {
  if (g.layers <= 0 || g.kv_heads <= 0 || g.head_dim <= 0 || g.capacity <= 0)
    throw std::invalid_argument("KV cache geometry must be positive");
  if (page_size <= 0) throw std::invalid_argument("page size must be positive, got " + std::to_string(page_size));
  kvcache::CacheConfig c;
  c.layers = g.layers;
  c.kv_heads = g.kv_heads;
  c.head_dim = g.head_dim;
  c.capacity = g.capacity;
  c.page_size = page_size;
  c.pool_pages = pages;
  c.windows = std::move(windows);
  c.k_format = formats::KvFormat::parse("fp16");
  c.v_format = formats::KvFormat::parse("fp16");
  // fp16 keys carry no witness; the band layout need only fit the head size.
  c.bands = std::gcd(c.bands, std::max(1, g.head_dim / 2));
  return c;
}

ExactKvCache::ExactKvCache(const kvcache::KvGeometry& g, int page_size, std::vector<std::int64_t> windows)
    : store_(exact_config(g, page_size, 0, std::move(windows))), g_(g) {}

ExactKvCache::ExactKvCache(std::shared_ptr<kvcache::KvPool> pool)
    : store_(fp16_pool(pool)), g_(geometry_of(store_.config())) {}

ExactKvCache::ExactKvCache(const ExactKvCache& other)
    : kvcache::KvCache(other),
      store_(exact_config(other.g_, other.store_.config().page_size, 0, other.store_.config().windows)),
      g_(other.g_) {
  // The rows round-trip through float exactly, so rewriting them gives the same bytes.
  store_.set_prompt_length(other.store_.prompt_length());
  std::vector<float> k(static_cast<std::size_t>(g_.head_dim)), v(k.size());
  for (int l = 0; l < g_.layers; ++l)
    for (int h = 0; h < g_.kv_heads; ++h)
      for (std::int64_t p = 0; p < other.store_.length(l, h); ++p) {
        if (p < other.store_.retired_end(l)) {  // read no more: any row will do
          std::fill(k.begin(), k.end(), 0.0f);
          store_.write(l, h, p, k.data(), k.data());
          continue;
        }
        const f16* ok = other.key(l, h, p);
        const f16* ov = other.value(l, h, p);
        for (int i = 0; i < g_.head_dim; ++i) k[i] = fp16_to_float(ok[i]), v[i] = fp16_to_float(ov[i]);
        store_.write(l, h, p, k.data(), v.data());
      }
  store_.retire_before(other.store_.retired_at());
}

bool ExactKvCache::share_prefix(const kvcache::KvCache& donor, std::int64_t n) {
  const auto* d = dynamic_cast<const ExactKvCache*>(&donor);
  if (d == nullptr || d->pool() != pool()) return false;
  return store_.share_prefix(d->store_, n);
}

const f16* ExactKvCache::key(int layer, int kv_head, std::int64_t pos) const {
  return kvcache::KvStore::Reader(store_, layer, kv_head).exact_key_row(pos);
}

const f16* ExactKvCache::value(int layer, int kv_head, std::int64_t pos) const {
  return kvcache::KvStore::Reader(store_, layer, kv_head).exact_value_row(pos);
}

void ExactKvCache::write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) {
  store_.write(layer, kv_head, pos, k, v);
}

ExactKvCache::Scratch& ExactKvCache::rows(int layer, int kv_head, std::int64_t begin, std::int64_t end) const {
  thread_local Scratch r;
  r.keys.resize(end);
  r.values.resize(end);
  const kvcache::KvStore::Reader reader(store_, layer, kv_head);
  const std::int64_t page = store_.config().page_size;
  const int d = g_.head_dim;
  for (std::int64_t t0 = begin; t0 < end; t0 = (t0 / page + 1) * page) {  // a page's rows follow one another
    const f16* k = reader.exact_key_row(t0);
    const f16* v = reader.exact_value_row(t0);
    for (std::int64_t t = t0; t < std::min(end, (t0 / page + 1) * page); ++t, k += d, v += d) {
      r.keys[t] = k;
      r.values[t] = v;
    }
  }
  return r;
}

void ExactKvCache::attend(int layer, int kv_head, const float* q, int group, std::int64_t begin, std::int64_t end,
                          float* out) {
  // The SIMD exact path, bit-identical to exact_attention (exact_attention_fast_test.cc).
  Scratch& r = rows(layer, kv_head, begin, end);
  exact_attention_group(q, group, r.keys.data() + begin, r.values.data() + begin, end - begin, g_.head_dim, out, r.work);
}

void ExactKvCache::attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group,
                                 std::int64_t pos0, std::int64_t n, std::int64_t window, float* out,
                                 std::int64_t out_stride) {
  const int d = g_.head_dim;
  const std::size_t row = static_cast<std::size_t>(group) * d;
  Scratch& r = rows(layer, kv_head, kvcache::window_begin(pos0, window), pos0 + n);
  r.queries.resize(n * row);
  r.outputs.resize(n * row);
  r.begins.resize(n * group);
  r.ends.resize(n * group);
  for (std::int64_t i = 0; i < n; ++i) {
    std::copy(q + i * q_stride, q + i * q_stride + row, &r.queries[i * row]);
    std::fill_n(&r.begins[i * group], group, kvcache::window_begin(pos0 + i, window));
    std::fill_n(&r.ends[i * group], group, pos0 + i + 1);
  }
  exact_attention_multi(r.queries.data(), static_cast<int>(n * group), r.begins.data(), r.ends.data(), r.keys.data(),
                        r.values.data(), d, r.outputs.data(), r.work);
  for (std::int64_t i = 0; i < n; ++i)
    std::copy(&r.outputs[i * row], &r.outputs[(i + 1) * row], out + i * out_stride);
}

}  // namespace witcert::attention
