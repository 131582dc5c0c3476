// The exact KV cache: keys and values stored as the fp16 values the model produced, with a
// plain softmax attention over them. This is the reference every compressed format is
// measured against.
#pragma once

#include <vector>

#include "attn/kv_cache.h"
#include "base/fp16.h"

namespace witcert::attn {

class ExactKvCache final : public KvCache {
 public:
  explicit ExactKvCache(const KvGeometry& g);

  const KvGeometry& geometry() const override { return g_; }
  void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) override;
  void attend(int layer, int kv_head, const float* q, int group, std::int64_t n_ctx, float* out) const override;
  void clear() override {}

  // The stored key / value of one position (head_dim fp16 values).
  const f16* key(int layer, int kv_head, std::int64_t pos) const { return &k_[index(layer, kv_head, pos)]; }
  const f16* value(int layer, int kv_head, std::int64_t pos) const { return &v_[index(layer, kv_head, pos)]; }

  std::size_t bytes() const { return (k_.size() + v_.size()) * sizeof(f16); }

 private:
  std::size_t index(int layer, int kv_head, std::int64_t pos) const;

  KvGeometry g_;
  std::vector<f16> k_, v_;
};

// softmax(sm · q·kᵀ)·V for one query over n_ctx fp16 keys and values laid out with stride
// head_dim. Scalar and deterministic; shared by the exact cache and by tests.
void exact_attention(const float* q, const f16* keys, const f16* values, std::int64_t n_ctx, int head_dim,
                     float* out);

}  // namespace witcert::attn
