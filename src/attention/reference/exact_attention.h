// The scalar reference of the exact (fp16) attention: every fp16 cache path agrees with it bit
// for bit, and the SIMD path (attention/cpu/exact_attention_fast.h) is tested against it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "base/fp16.h"

namespace witcert::attention {

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

}  // namespace witcert::attention
