// The cache a request runs on, built from typed options for a model's geometry: the plain exact
// cache, or the certified cache with its store, meter, gate and sinks.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "engine/options.h"
#include "gate/certified_cache.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_store.h"
#include "model/llama.h"

namespace witcert::engine {

struct Cache {
  std::unique_ptr<kvcache::KvCache> kv;
  gate::CertifiedKvCache* certified = nullptr;  // kv as the certified cache; null for the plain exact cache
};

// The store's settings for `capacity` positions of the model's geometry and RoPE layout.
kvcache::CacheConfig cache_config(const model::LlamaConfig& model, std::int64_t capacity, const CacheOptions& opts);

// decode_budget is T of δ_loc = δ_req/(L·H·T); sinks receive every served cell (not owned).
// Throws std::invalid_argument for options validate() rejects or a format the geometry cannot hold.
Cache make_cache(const model::LlamaConfig& model, std::int64_t capacity, std::int64_t decode_budget,
                 const CacheOptions& opts, std::vector<gate::MeterSink*> sinks = {});

// A pool of pages that many sequences share: the one store's, in the request's formats (fp16 on
// both sides for the plain exact cache).
struct Pool {
  std::shared_ptr<kvcache::KvPool> kv;
  bool certified = false;  // its sequences are certified caches; else plain exact caches

  std::int64_t pages() const;
  std::int64_t free_pages() const;
  int page_size() const;
  // Measured bytes of the pool's allocations: the compressed cache, and the exact backing tier.
  std::size_t bytes() const;
  std::size_t backing_bytes() const;
  bool has_exact_tier() const;  // a gate or soundness check can read exact rows (the plain cache is exact)
  // Measured bytes of the own state of a sequence over this pool, whose pool config fixes its
  // capacity (page table, group blocks, ring, repair flags), from a probe sequence.
  std::size_t sequence_bytes() const;
};

// How many pages a memory budget holds, measured from allocations: the bytes of a pool of one
// and of two pages give the bytes of a page and the pool's fixed part, and a sequence's own state
// (page table, group blocks, ring, repair flags) is measured on a probe sequence of `capacity`.
struct PoolSizing {
  std::int64_t pages = 0;
  std::size_t page_bytes = 0;      // compressed bytes per page (every layer and KV head)
  std::size_t fixed_bytes = 0;     // the pool's bytes that do not grow with its pages
  std::size_t sequence_bytes = 0;  // a sequence's own state
};
// The pages that `budget` bytes hold beside max_seqs sequences' own state. Throws
// std::invalid_argument when not even one page fits.
PoolSizing size_pool(const model::LlamaConfig& model, std::int64_t capacity, const CacheOptions& opts,
                     std::int64_t budget, int max_seqs);

// What this machine can give new allocations now, from /proc/meminfo, in bytes.
struct AvailableMemory {
  bool known = false;          // false: /proc/meminfo could not be read
  std::int64_t available = 0;  // MemAvailable: RAM that can be had without swapping
  std::int64_t swap_free = 0;  // SwapFree
};
AvailableMemory available_memory();

// Refuses a --kv-memory budget this machine cannot hold: the budget, plus the exact tier of a
// pool of `pages` when that tier is kept in RAM, against MemAvailable + SwapFree. The pool commits
// its pages only as they are written, so a budget beyond memory would start and fail under load.
// Throws std::invalid_argument naming the budget and both numbers; accepts anything where
// `memory` is not known.
void check_kv_memory(const model::LlamaConfig& model, const CacheOptions& opts, std::int64_t budget, std::int64_t pages,
                     bool exact_tier, const AvailableMemory& memory);

// A pool of `pages` pages for sequences of up to `capacity` positions; exact_tier keeps the
// backing tier (a gate or the soundness check reads it) whatever opts says.
Pool make_pool(const model::LlamaConfig& model, std::int64_t capacity, std::int64_t pages, const CacheOptions& opts,
               bool exact_tier);

// A new sequence over the pool with its own gate, δ, bound, soundness check and sinks (opts:
// the pool's formats with the request's settings). Throws std::invalid_argument as make_cache.
Cache make_sequence_cache(const Pool& pool, const model::LlamaConfig& model, std::int64_t decode_budget,
                          const CacheOptions& opts, std::vector<gate::MeterSink*> sinks = {});

}  // namespace witcert::engine
