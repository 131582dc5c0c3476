// The exact KV cache: keys and values stored as the fp16 values the model produced, in pages of a
// pool as the certified cache keeps them, with a plain softmax attention over them. This is the
// reference every compressed format is measured against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "attn/exact_attention_fast.h"
#include "attn/kv_cache.h"
#include "base/fp16.h"
#include "cache/page_pool.h"

namespace witcert::attn {

// The fp16 keys and values of every sequence over one pool of pages: [layer][KV head][slot][head_dim].
// geometry().capacity is the positions of one sequence.
class ExactPool {
 public:
  // pages = 0: enough pages for one sequence of capacity.
  ExactPool(const KvGeometry& g, int page_size = 16, std::int64_t pages = 0);
  ExactPool(const ExactPool& other);  // every page, free and taken alike
  ExactPool& operator=(const ExactPool&) = delete;

  const KvGeometry& geometry() const { return g_; }
  int page_size() const { return pool_.page_size(); }
  std::int64_t pages() const { return pool_.pages(); }
  std::int64_t free_pages() const { return pool_.free_pages(); }
  // Measured bytes of the allocations.
  std::size_t bytes() const { return (k_.size() + v_.size()) * sizeof(f16); }

 private:
  friend class ExactKvCache;
  KvGeometry g_;
  cache::PagePool pool_;
  // Reserved, not committed: a page takes memory when first written, so a large pool costs
  // nothing until it fills (the budget of `witcert serve --kv-memory` with the plain cache).
  cache::ReservedArray<f16> k_, v_;
};

// One sequence's exact cache: over a pool of its own, or over a pool it shares with other
// sequences (destroying or clearing it returns its pages).
class ExactKvCache final : public KvCache {
 public:
  explicit ExactKvCache(const KvGeometry& g, int page_size = 16);
  // A new sequence over a shared pool (not null).
  explicit ExactKvCache(std::shared_ptr<ExactPool> pool);
  // A copy of the positions written so far, with a pool of its own (a prefilled prompt reused).
  ExactKvCache(const ExactKvCache& other);
  ExactKvCache& operator=(const ExactKvCache&) = delete;

  const KvGeometry& geometry() const override { return pool_->g_; }
  void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) override;
  void attend(int layer, int kv_head, const float* q, int group, std::int64_t n_ctx, float* out) override;
  // The run's n·group queries in one pass over the rows, each bit for bit its own attend.
  void attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group, std::int64_t pos0,
                     std::int64_t n, float* out, std::int64_t out_stride) override;
  void clear() override { table_.clear(); }
  // Shares whole pages of an exact cache over the same pool (n a multiple of the page size).
  bool share_prefix(const KvCache& donor, std::int64_t n) override;

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
  cache::PageTable table_;
};

// softmax(sm · q·kᵀ)·V for one query over n_ctx fp16 keys and values; key_row(t) and
// value_row(t) return position t's head_dim values. Scalar, in float, in one fixed order: every
// fp16 cache path computes through this one function, so they agree bit for bit.
template <class KeyRow, class ValueRow>
void exact_attention(const float* q, KeyRow key_row, ValueRow value_row, std::int64_t n_ctx, int head_dim,
                     float* out) {
  const float sm = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> score(n_ctx);
  float max_score = -INFINITY;
  for (std::int64_t t = 0; t < n_ctx; ++t) {
    const f16* k = key_row(t);
    float dot = 0.0f;
    for (int i = 0; i < head_dim; ++i) dot += q[i] * fp16_to_float(k[i]);
    score[t] = sm * dot;
    max_score = std::max(max_score, score[t]);
  }
  float sum = 0.0f;
  for (std::int64_t t = 0; t < n_ctx; ++t) sum += score[t] = std::exp(score[t] - max_score);
  for (int i = 0; i < head_dim; ++i) out[i] = 0.0f;
  for (std::int64_t t = 0; t < n_ctx; ++t) {
    const float p = score[t] / sum;
    const f16* v = value_row(t);
    for (int i = 0; i < head_dim; ++i) out[i] += p * fp16_to_float(v[i]);
  }
}

}  // namespace witcert::attn
