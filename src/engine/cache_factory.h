// The cache a request runs on, built from typed options for a model's geometry: the plain exact
// cache, or the certified cache with its store, meter, gate and sinks.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attn/kv_cache.h"
#include "cache/kv_store.h"
#include "engine/options.h"
#include "gate/certified_cache.h"
#include "model/llama.h"

namespace witcert::engine {

struct Cache {
  std::unique_ptr<attn::KvCache> kv;
  gate::CertifiedKvCache* certified = nullptr;  // kv as the certified cache; null for the plain exact cache
};

// The store's settings for `capacity` positions of the model's geometry and RoPE layout.
cache::CacheConfig cache_config(const model::LlamaConfig& model, std::int64_t capacity, const CacheOptions& opts);

// decode_budget is T of δ_loc = δ_req/(L·H·T); sinks receive every served cell (not owned).
// Throws std::invalid_argument for options validate() rejects or a format the geometry cannot hold.
Cache make_cache(const model::LlamaConfig& model, std::int64_t capacity, std::int64_t decode_budget,
                 const CacheOptions& opts, std::vector<gate::MeterSink*> sinks = {});

}  // namespace witcert::engine
