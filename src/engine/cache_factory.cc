#include "engine/cache_factory.h"

#include <algorithm>

#include "attn/exact_cache.h"

namespace witcert::engine {

cache::CacheConfig cache_config(const model::LlamaConfig& model, std::int64_t capacity, const CacheOptions& opts) {
  cache::CacheConfig c;
  c.layers = model.layers;
  c.kv_heads = model.kv_heads;
  c.head_dim = model.head_dim;
  c.capacity = capacity;
  c.rope_layout = model.rope_layout;
  c.k_format = opts.k_format;
  c.v_format = opts.v_format;
  c.page_size = opts.page_size;
  c.outlier_pairs = opts.outliers;
  c.seed = opts.dither_seed;
  c.dither = opts.dither;
  c.backing = opts.backing;
  return c;
}

Cache make_cache(const model::LlamaConfig& model, std::int64_t capacity, std::int64_t decode_budget,
                 const CacheOptions& opts, std::vector<gate::MeterSink*> sinks) {
  opts.validate();
  Cache c;
  if (!opts.certified) {
    c.kv = std::make_unique<attn::ExactKvCache>(model.kv_geometry(capacity));
    return c;
  }
  gate::CertifiedOptions o;
  o.q_heads = model.heads;
  o.delta_req = opts.delta;
  o.decode_budget = std::max<std::int64_t>(1, decode_budget);
  o.check_soundness = opts.check_soundness;
  o.bound = opts.bound;
  o.gate = opts.gate;
  o.sinks = std::move(sinks);
  auto certified = std::make_unique<gate::CertifiedKvCache>(cache_config(model, capacity, opts), o);
  c.certified = certified.get();
  c.kv = std::move(certified);
  return c;
}

}  // namespace witcert::engine
