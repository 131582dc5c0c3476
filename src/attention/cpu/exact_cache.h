// The exact KV cache: keys and values stored as the fp16 values the model produced, in pages of a
// pool as the certified cache keeps them, with a plain softmax attention over them. This is the
// reference every compressed format is measured against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "attention/cpu/exact_attention_fast.h"
#include "attention/reference/exact_attention.h"
#include "base/fp16.h"
#include "kvcache/kv_cache.h"
#include "kvcache/page_pool.h"

namespace witcert::attention {

// The fp16 keys and values of every sequence over one pool of pages: [layer][KV head][slot][head_dim].
// geometry().capacity is the positions of one sequence.
class ExactPool {
 public:
  // pages = 0: enough pages for one sequence of capacity.
  ExactPool(const kvcache::KvGeometry& g, int page_size = 16, std::int64_t pages = 0);
  ExactPool(const ExactPool& other);  // every page, free and taken alike
  ExactPool& operator=(const ExactPool&) = delete;

  const kvcache::KvGeometry& geometry() const { return g_; }
  int page_size() const { return pool_.page_size(); }
  std::int64_t pages() const { return pool_.pages(); }
  std::int64_t free_pages() const { return pool_.free_pages(); }
  // Measured bytes of the allocations.
  std::size_t bytes() const { return (k_.size() + v_.size()) * sizeof(f16); }

 private:
  friend class ExactKvCache;
  kvcache::KvGeometry g_;
  kvcache::PagePool pool_;
  // Reserved, not committed: a page takes memory when first written, so a large pool costs
  // nothing until it fills (the budget of `witcert serve --kv-memory` with the plain cache).
  kvcache::ReservedArray<f16> k_, v_;
};

// One sequence's exact cache: over a pool of its own, or over a pool it shares with other
// sequences (destroying or clearing it returns its pages).
class ExactKvCache final : public kvcache::KvCache {
 public:
  explicit ExactKvCache(const kvcache::KvGeometry& g, int page_size = 16);
  // A new sequence over a shared pool (not null).
  explicit ExactKvCache(std::shared_ptr<ExactPool> pool);
  // A copy of the positions written so far, with a pool of its own (a prefilled prompt reused).
  ExactKvCache(const ExactKvCache& other);
  ExactKvCache& operator=(const ExactKvCache&) = delete;

  const kvcache::KvGeometry& geometry() const override { return pool_->g_; }
  void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) override;
  void attend(int layer, int kv_head, const float* q, int group, std::int64_t n_ctx, float* out) override;
  // The run's n·group queries in one pass over the rows, each bit for bit its own attend.
  void attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group, std::int64_t pos0,
                     std::int64_t n, float* out, std::int64_t out_stride) override;
  void clear() override { table_.clear(); }
  // Shares whole pages of an exact cache over the same pool (n a multiple of the page size).
  bool share_prefix(const kvcache::KvCache& donor, std::int64_t n) override;

  // The stored key / value of one written position (head_dim fp16 values).
  const f16* key(int layer, int kv_head, std::int64_t pos) const { return &pool_->k_[index(layer, kv_head, pos)]; }
  const f16* value(int layer, int kv_head, std::int64_t pos) const { return &pool_->v_[index(layer, kv_head, pos)]; }

  // The pool's measured bytes, and the pages this sequence holds.
  std::size_t bytes() const { return pool_->bytes(); }
  std::int64_t pages() const { return table_.page_count(); }
  const std::shared_ptr<ExactPool>& pool() const { return pool_; }

 private:
  std::size_t index(int layer, int kv_head, std::int64_t pos) const;
  // The calling thread's buffers, reused by its every call so that attention allocates nothing
  // once warm: the key and value row pointers the SIMD attention reads, a run's gathered queries,
  // outputs and lengths, and the attention's workspace.
  struct Scratch {
    std::vector<const f16*> keys, values;
    std::vector<float> queries, outputs;
    std::vector<std::int64_t> lengths;
    ExactWorkspace work;
  };
  // The scratch with the rows of positions [0, n) filled in (valid until the thread's next call).
  Scratch& rows(int layer, int kv_head, std::int64_t n) const;

  std::shared_ptr<ExactPool> pool_;
  kvcache::PageTable table_;
};

}  // namespace witcert::attention
