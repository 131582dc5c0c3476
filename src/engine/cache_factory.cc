#include "engine/cache_factory.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

#include "attention/cpu/exact_cache.h"

namespace witcert::engine {

kvcache::CacheConfig cache_config(const model::LlamaConfig& model, std::int64_t capacity, const CacheOptions& opts) {
  kvcache::CacheConfig c;
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
  c.key_scales = opts.key_scales;
  c.backing = opts.backing;
  c.windows = model.windows;
  return c;
}

namespace {

gate::CertifiedOptions certified_options(const model::LlamaConfig& model, std::int64_t decode_budget,
                                         const CacheOptions& opts, std::vector<gate::MeterSink*> sinks) {
  gate::CertifiedOptions o;
  o.q_heads = model.heads;
  o.delta_req = opts.delta;
  o.decode_budget = std::max<std::int64_t>(1, decode_budget);
  o.check_soundness = opts.check_soundness;
  o.bound = opts.bound;
  o.gate = opts.gate;
  o.sinks = std::move(sinks);
  return o;
}

// Whether a certified pool keeps the exact backing tier: asked for, or read by a gate or the check.
bool keeps_exact_tier(const CacheOptions& opts, bool exact_tier) {
  return opts.certified && (exact_tier || opts.gate.on() || opts.check_soundness);
}

// "N bytes (x.xx GiB)".
std::string bytes_text(double bytes) {
  char text[96];
  std::snprintf(text, sizeof text, "%.0f bytes (%.2f GiB)", bytes, bytes / (1024.0 * 1024.0 * 1024.0));
  return text;
}

}  // namespace

Cache make_cache(const model::LlamaConfig& model, std::int64_t capacity, std::int64_t decode_budget,
                 const CacheOptions& opts, std::vector<gate::MeterSink*> sinks) {
  opts.validate();
  Cache c;
  if (!opts.certified) {
    c.kv = std::make_unique<attention::ExactKvCache>(model.kv_geometry(capacity), opts.page_size, model.windows);
    return c;
  }
  auto certified = std::make_unique<gate::CertifiedKvCache>(
      cache_config(model, capacity, opts), certified_options(model, decode_budget, opts, std::move(sinks)));
  c.certified = certified.get();
  c.kv = std::move(certified);
  return c;
}


std::int64_t Pool::pages() const { return kv ? kv->pages() : 0; }
std::int64_t Pool::free_pages() const { return kv ? kv->free_pages() : 0; }
int Pool::page_size() const { return kv ? kv->config().page_size : 0; }
std::size_t Pool::bytes() const { return kv ? kv->bytes() : 0; }
std::size_t Pool::backing_bytes() const { return kv ? kv->backing_bytes() : 0; }
bool Pool::has_exact_tier() const { return !certified || (kv && kv->has_exact_tier()); }
std::size_t Pool::sequence_bytes() const { return kv ? kvcache::KvStore(kv).sequence().bytes() : 0; }

Pool make_pool(const model::LlamaConfig& model, std::int64_t capacity, std::int64_t pages, const CacheOptions& opts,
               bool exact_tier) {
  opts.validate();
  if (pages < 0) throw std::invalid_argument("the pool's page count is negative");
  Pool p;
  p.certified = opts.certified;
  if (!opts.certified) {
    p.kv = std::make_shared<kvcache::KvPool>(attention::exact_config(model.kv_geometry(capacity), opts.page_size, pages, model.windows));
    return p;
  }
  kvcache::CacheConfig cfg = cache_config(model, capacity, opts);
  cfg.pool_pages = pages;
  cfg.exact_tier = keeps_exact_tier(opts, exact_tier);
  p.kv = std::make_shared<kvcache::KvPool>(cfg);
  return p;
}

AvailableMemory available_memory() {
  AvailableMemory m;
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  std::int64_t kib = 0;
  bool available = false, swap = false;
  while (in >> key >> kib) {
    std::getline(in, unit);  // " kB"
    if (key == "MemAvailable:") {
      m.available = kib * 1024;
      available = true;
    } else if (key == "SwapFree:") {
      m.swap_free = kib * 1024;
      swap = true;
    }
  }
  m.known = available && swap;
  return m;
}

void check_kv_memory(const model::LlamaConfig& model, const CacheOptions& opts, std::int64_t budget, std::int64_t pages,
                     bool exact_tier, const AvailableMemory& memory) {
  if (!memory.known) return;
  // In double: an absurd budget's tier would overflow 64 bits, and a few bytes do not matter here.
  const double tier = keeps_exact_tier(opts, exact_tier) && opts.backing.ram
                          ? 2.0 * model.layers * model.kv_heads * model.head_dim * sizeof(f16) *
                                static_cast<double>(pages) * opts.page_size
                          : 0.0;
  const double have = static_cast<double>(memory.available) + static_cast<double>(memory.swap_free);
  if (static_cast<double>(budget) + tier <= have) return;
  const std::string with_tier = tier > 0 ? " with its exact tier in RAM (" + bytes_text(tier) + ")" : "";
  throw std::invalid_argument("kv_memory " + bytes_text(static_cast<double>(budget)) + with_tier +
                              " is more than this machine has available: MemAvailable " +
                              bytes_text(static_cast<double>(memory.available)) + " + SwapFree " +
                              bytes_text(static_cast<double>(memory.swap_free)) + " (/proc/meminfo)");
}

PoolSizing size_pool(const model::LlamaConfig& model, std::int64_t capacity, const CacheOptions& opts,
                     std::int64_t budget, int max_seqs) {
  if (budget <= 0) throw std::invalid_argument("the KV memory budget must be positive");
  if (max_seqs < 1) throw std::invalid_argument("at most 0 sequences: max_seqs must be at least 1");
  // Probes without the exact tier: it is accounted apart from the budget.
  const Pool one = make_pool(model, capacity, 1, opts, false), two = make_pool(model, capacity, 2, opts, false);
  PoolSizing s;
  s.page_bytes = two.bytes() - one.bytes();
  s.fixed_bytes = one.bytes() - s.page_bytes;
  s.sequence_bytes = one.sequence_bytes();
  const std::size_t reserved = s.fixed_bytes + static_cast<std::size_t>(max_seqs) * s.sequence_bytes;
  if (static_cast<std::size_t>(budget) < reserved + s.page_bytes)
    throw std::invalid_argument("kv_memory " + std::to_string(budget) + " bytes holds not one page of " +
                                std::to_string(opts.page_size) + " tokens beside " + std::to_string(max_seqs) +
                                " sequences' own state (" + std::to_string(reserved + s.page_bytes) + " bytes needed)");
  s.pages = static_cast<std::int64_t>((static_cast<std::size_t>(budget) - reserved) / s.page_bytes);
  return s;
}

Cache make_sequence_cache(const Pool& pool, const model::LlamaConfig& model, std::int64_t decode_budget,
                          const CacheOptions& opts, std::vector<gate::MeterSink*> sinks) {
  opts.validate();
  Cache c;
  if (!pool.kv) throw std::invalid_argument("make_sequence_cache: no pool");
  if (!pool.certified) {
    c.kv = std::make_unique<attention::ExactKvCache>(pool.kv);
    return c;
  }
  auto certified = std::make_unique<gate::CertifiedKvCache>(pool.kv,
                                                            certified_options(model, decode_budget, opts, std::move(sinks)));
  c.certified = certified.get();
  c.kv = std::move(certified);
  return c;
}

}  // namespace witcert::engine
