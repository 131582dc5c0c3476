#include "attn/exact_cache.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace witcert::attn {

ExactKvCache::ExactKvCache(const KvGeometry& g) : g_(g) {
  if (g.layers <= 0 || g.kv_heads <= 0 || g.head_dim <= 0 || g.capacity <= 0)
    throw std::invalid_argument("KV cache geometry must be positive");
  const std::size_t n = static_cast<std::size_t>(g.layers) * g.kv_heads * g.capacity * g.head_dim;
  k_.assign(n, 0);
  v_.assign(n, 0);
}

std::size_t ExactKvCache::index(int layer, int kv_head, std::int64_t pos) const {
  return ((static_cast<std::size_t>(layer) * g_.kv_heads + kv_head) * g_.capacity + pos) * g_.head_dim;
}

void ExactKvCache::write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) {
  if (pos < 0 || pos >= g_.capacity)
    throw std::out_of_range("KV cache position " + std::to_string(pos) + " outside capacity " +
                            std::to_string(g_.capacity));
  f16* kd = &k_[index(layer, kv_head, pos)];
  f16* vd = &v_[index(layer, kv_head, pos)];
  for (int i = 0; i < g_.head_dim; ++i) {
    kd[i] = fp16_from_float(k[i]);
    vd[i] = fp16_from_float(v[i]);
  }
}

void ExactKvCache::attend(int layer, int kv_head, const float* q, int group, std::int64_t n_ctx, float* out) const {
  const f16* keys = &k_[index(layer, kv_head, 0)];
  const f16* values = &v_[index(layer, kv_head, 0)];
  for (int h = 0; h < group; ++h)
    exact_attention(q + h * g_.head_dim, keys, values, n_ctx, g_.head_dim, out + h * g_.head_dim);
}

void exact_attention(const float* q, const f16* keys, const f16* values, std::int64_t n_ctx, int head_dim,
                     float* out) {
  const float sm = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> score(n_ctx);
  float max_score = -INFINITY;
  for (std::int64_t t = 0; t < n_ctx; ++t) {
    const f16* k = keys + t * head_dim;
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
    const f16* v = values + t * head_dim;
    for (int i = 0; i < head_dim; ++i) out[i] += p * fp16_to_float(v[i]);
  }
}

}  // namespace witcert::attn
