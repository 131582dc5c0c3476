// The exact (fp16) attention path in SIMD, for CertifiedKvCache's fp16 formats: the same result as
// exact_attention (exact_cache.h), bit for bit, for the `group` query heads that share a KV head.
//
// Bit identity holds because nothing is reassociated: each score is the same sequence of float
// products and sums over the channels (the query heads are the SIMD lanes), each output element
// the same sequence over the tokens (the channels are the lanes), the softmax maximum, exponentials
// and sum are the same scalar std::max, std::exp and additions, and the file is compiled without
// floating-point contraction (CMakeLists.txt). Only NaN payloads may differ: the hardware fp16
// conversion quiets signalling NaNs.
#pragma once

#include <cstdint>
#include <vector>

#include "base/fp16.h"

namespace witcert::attention {

// The buffers of one call (scores, transposed queries, float key and value tiles, accumulators),
// owned by the caller and reused: a call allocates only while a buffer grows. One per thread.
struct ExactWorkspace {
  std::vector<float> score, sum, q_t, k_rows, v_rows, p, acc;
  std::vector<std::int64_t> begins, ends;
};

// q: group × head_dim queries; key_rows[t], value_rows[t]: position t's head_dim fp16 values;
// out: group × head_dim.
void exact_attention_group(const float* q, int group, const f16* const* key_rows, const f16* const* value_rows,
                           std::int64_t n_ctx, int head_dim, float* out, ExactWorkspace& ws);

// The same for `queries` queries that each attend over their own rows [begins[i], ends[i])
// (begins[i] < ends[i]; key_rows and value_rows must hold every row from the smallest begin to the
// largest end): each output is bit for bit exact_attention over its own rows. The keys and values
// are read once for all of them (a run of causal prefill positions, under a sliding window or not).
void exact_attention_multi(const float* q, int queries, const std::int64_t* begins, const std::int64_t* ends,
                           const f16* const* key_rows, const f16* const* value_rows, int head_dim, float* out,
                           ExactWorkspace& ws);

// The same in a workspace of the calling thread, kept for its next call.
void exact_attention_group(const float* q, int group, const f16* const* key_rows, const f16* const* value_rows,
                           std::int64_t n_ctx, int head_dim, float* out);
void exact_attention_multi(const float* q, int queries, const std::int64_t* begins, const std::int64_t* ends,
                           const f16* const* key_rows, const f16* const* value_rows, int head_dim, float* out);

}  // namespace witcert::attention
