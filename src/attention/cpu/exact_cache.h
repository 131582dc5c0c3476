// The exact KV cache: keys and values stored as the fp16 values the model produced — the fp16
// format of the one paged store (kvcache::KvStore), without a meter — with a plain softmax
// attention over them. This is the reference every compressed format is measured against.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attention/cpu/exact_attention_fast.h"
#include "base/fp16.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_store.h"

namespace witcert::attention {

// The store settings of an exact cache: fp16 on both sides, no backing tier (the rows are exact);
// `windows` as kvcache::CacheConfig::windows.
kvcache::CacheConfig exact_config(const kvcache::KvGeometry& g, int page_size = 16, std::int64_t pages = 0,
                                  std::vector<std::int64_t> windows = {});

// One sequence's exact cache: over a pool of its own, or over an fp16 pool it shares with other
// sequences (destroying or clearing it returns its pages).
class ExactKvCache final : public kvcache::KvCache {
 public:
  explicit ExactKvCache(const kvcache::KvGeometry& g, int page_size = 16, std::vector<std::int64_t> windows = {});
  // A new sequence over a shared pool (not null) whose formats are fp16 on both sides.
  explicit ExactKvCache(std::shared_ptr<kvcache::KvPool> pool);
  // A copy of the positions written so far, with a pool of its own (a prefilled prompt reused), and
  // the same positions retired.
  ExactKvCache(const ExactKvCache& other);
  ExactKvCache& operator=(const ExactKvCache&) = delete;

  const kvcache::KvGeometry& geometry() const override { return g_; }
  void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) override;
  using kvcache::KvCache::attend;
  void attend(int layer, int kv_head, const float* q, int group, std::int64_t begin, std::int64_t end,
              float* out) override;
  // The run's n·group queries in one pass over the rows, each bit for bit its own attend.
  void attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group, std::int64_t pos0,
                     std::int64_t n, std::int64_t window, float* out, std::int64_t out_stride) override;
  void clear() override { store_.clear(); }
  void set_prompt_length(std::int64_t n) override { store_.set_prompt_length(n); }
  void retire_before(std::int64_t pos) override { store_.retire_before(pos); }
  // Shares whole pages of an exact cache over the same pool (n a multiple of the page size).
  bool share_prefix(const kvcache::KvCache& donor, std::int64_t n) override;

  // The stored key / value of one written position (head_dim fp16 values).
  const f16* key(int layer, int kv_head, std::int64_t pos) const;
  const f16* value(int layer, int kv_head, std::int64_t pos) const;

  // The pool's measured bytes, and the pages this sequence holds.
  std::size_t bytes() const { return store_.pool().bytes(); }
  std::int64_t pages() const { return store_.sequence().pages(); }
  const std::shared_ptr<kvcache::KvPool>& pool() const { return store_.shared_pool(); }

 private:
  // The calling thread's buffers, reused by its every call so that attention allocates nothing
  // once warm: the key and value row pointers the SIMD attention reads (index t: position t), a
  // run's gathered queries, outputs and ranges, and the attention's workspace.
  struct Scratch {
    std::vector<const f16*> keys, values;
    std::vector<float> queries, outputs;
    std::vector<std::int64_t> begins, ends;
    ExactWorkspace work;
  };
  // The scratch with the rows of positions [begin, end) filled in (valid until the thread's next call).
  Scratch& rows(int layer, int kv_head, std::int64_t begin, std::int64_t end) const;

  kvcache::KvStore store_;
  kvcache::KvGeometry g_;
};

}  // namespace witcert::attention
