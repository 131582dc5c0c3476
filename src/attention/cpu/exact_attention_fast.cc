#include "attention/cpu/exact_attention_fast.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/cpu/exact_attention_fast.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "attention/cpu/load_f16-inl.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::attention {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
constexpr std::size_t kW = hn::MaxLanes(DF());
constexpr int kTokens = 8;  // independent score chains per pass over the channels
constexpr int kTile = 16;   // value rows converted at once

// head_dim fp16 values as floats (exact), padded to whole vectors with zeros.
void FloatRow(const f16* src, int d, float* out) {
  const DF df;
  int c = 0;
  for (; c + static_cast<int>(kW) <= d; c += static_cast<int>(kW)) hn::StoreU(LoadF16(df, src + c), df, out + c);
  for (; c < d; ++c) out[c] = fp16_to_float(src[c]);
}

// out[c + k·kW ..] += p_t·v_t over the tile, in token order: K independent columns.
template <std::size_t K>
HWY_INLINE void AccumulateColumns(const float* p, const float* rows, int n, std::size_t dp, std::size_t c, float* out) {
  const DF df;
  VF sum[K];
  for (std::size_t k = 0; k < K; ++k) sum[k] = hn::LoadU(df, out + c + k * kW);
  for (int t = 0; t < n; ++t) {
    const VF pt = hn::Set(df, p[t]);
    for (std::size_t k = 0; k < K; ++k) sum[k] = hn::Add(sum[k], hn::Mul(pt, hn::LoadU(df, rows + t * dp + c + k * kW)));
  }
  for (std::size_t k = 0; k < K; ++k) hn::StoreU(sum[k], df, out + c + k * kW);
}

// Every buffer comes from ws, refilled as a fresh vector would start (zeros): a warm workspace
// allocates nothing.
void ExactAttentionMulti(const float* q, int group, const std::int64_t* begins, const std::int64_t* ends,
                         const f16* const* key_rows, const f16* const* value_rows, int head_dim, float* out,
                         ExactWorkspace& ws) {
  const DF df;
  const int d = head_dim;
  const std::size_t dp = hwy::RoundUpTo(static_cast<std::size_t>(d), kW);
  const float sm = 1.0f / std::sqrt(static_cast<float>(d));
  // Scores are computed over every query's rows from the first begin to the last end (the extra
  // ones are never read); score column t − t_first holds position t.
  const std::int64_t t_first = *std::min_element(begins, begins + group);
  const std::int64_t n_ctx = *std::max_element(ends, ends + group) - t_first;
  std::vector<float>& score = ws.score;
  score.assign(static_cast<std::size_t>(group) * n_ctx, 0.0f);

  // Scores, kW query heads per vector: lane h accumulates q_h[i]·k_t[i] over i in order.
  std::vector<float>& q_t = ws.q_t;
  std::vector<float>& k_rows = ws.k_rows;
  q_t.assign(d * kW, 0.0f);
  k_rows.assign(kTokens * dp, 0.0f);
  HWY_ALIGN float lanes[kW];
  for (int h0 = 0; h0 < group; h0 += static_cast<int>(kW)) {
    const int heads = std::min(static_cast<int>(kW), group - h0);
    std::fill(q_t.begin(), q_t.end(), 0.0f);
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d; ++i) q_t[i * kW + h] = q[(h0 + h) * d + i];
    const std::int64_t lane_first = *std::min_element(begins + h0, begins + h0 + heads) - t_first;
    const std::int64_t n_lanes = *std::max_element(ends + h0, ends + h0 + heads) - t_first;
    for (std::int64_t t0 = lane_first; t0 < n_lanes; t0 += kTokens) {
      const int n = static_cast<int>(std::min<std::int64_t>(kTokens, n_lanes - t0));
      for (int j = 0; j < n; ++j) FloatRow(key_rows[t_first + t0 + j], d, &k_rows[j * dp]);
      VF dot[kTokens];
      for (VF& v : dot) v = hn::Zero(df);
      for (int i = 0; i < d; ++i) {
        const VF qi = hn::LoadU(df, &q_t[i * kW]);
        for (int j = 0; j < kTokens; ++j) dot[j] = hn::Add(dot[j], hn::Mul(qi, hn::Set(df, k_rows[j * dp + i])));
      }
      for (int j = 0; j < n; ++j) {
        hn::Store(hn::Mul(hn::Set(df, sm), dot[j]), df, lanes);
        for (int h = 0; h < heads; ++h) score[(h0 + h) * n_ctx + t0 + j] = lanes[h];
      }
    }
  }

  // The softmax of each head over its own context, scalar and in token order as in exact_attention.
  std::vector<float>& sum = ws.sum;
  sum.assign(group, 0.0f);
  for (int h = 0; h < group; ++h) {
    float* s = &score[h * n_ctx];
    const std::int64_t b = begins[h] - t_first, e = ends[h] - t_first;
    float max_score = -INFINITY;
    for (std::int64_t t = b; t < e; ++t) max_score = std::max(max_score, s[t]);
    float total = 0.0f;
    for (std::int64_t t = b; t < e; ++t) total += s[t] = std::exp(s[t] - max_score);
    sum[h] = total;
  }

  // Outputs, channels in lanes: out[i] += p_t·v_t[i] over t in order.
  std::vector<float>& acc = ws.acc;
  std::vector<float>& v_rows = ws.v_rows;
  std::vector<float>& p = ws.p;
  acc.assign(static_cast<std::size_t>(group) * dp, 0.0f);
  v_rows.assign(kTile * dp, 0.0f);
  p.assign(kTile, 0.0f);
  for (std::int64_t t0 = 0; t0 < n_ctx; t0 += kTile) {
    const int n_tile = static_cast<int>(std::min<std::int64_t>(kTile, n_ctx - t0));
    bool read = false;  // the tile's values, converted once for the first query that needs them
    for (int h = 0; h < group; ++h) {
      // Query h's tokens of the tile: [j0, n).
      const int j0 = static_cast<int>(std::clamp<std::int64_t>(begins[h] - t_first - t0, 0, n_tile));
      const int n = static_cast<int>(std::clamp<std::int64_t>(ends[h] - t_first - t0, 0, n_tile));
      if (n <= j0) continue;
      if (!read) {
        for (int j = 0; j < n_tile; ++j) FloatRow(value_rows[t_first + t0 + j], d, &v_rows[j * dp]);
        read = true;
      }
      for (int j = j0; j < n; ++j) p[j] = score[h * n_ctx + t0 + j] / sum[h];
      float* a = &acc[h * dp];
      const float* pj = p.data() + j0;
      const float* rows = v_rows.data() + static_cast<std::size_t>(j0) * dp;
      const int m = n - j0;
      std::size_t c = 0;
      for (; c + 8 * kW <= dp; c += 8 * kW) AccumulateColumns<8>(pj, rows, m, dp, c, a);
      for (; c + 4 * kW <= dp; c += 4 * kW) AccumulateColumns<4>(pj, rows, m, dp, c, a);
      for (; c < dp; c += kW) AccumulateColumns<1>(pj, rows, m, dp, c, a);
    }
  }
  for (int h = 0; h < group; ++h) std::copy_n(&acc[h * dp], d, out + h * d);
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::attention
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace witcert::attention {

HWY_EXPORT(ExactAttentionMulti);

namespace {

ExactWorkspace& thread_workspace() {
  thread_local ExactWorkspace ws;
  return ws;
}

}  // namespace

void exact_attention_multi(const float* q, int queries, const std::int64_t* begins, const std::int64_t* ends,
                           const f16* const* key_rows, const f16* const* value_rows, int head_dim, float* out,
                           ExactWorkspace& ws) {
  if (queries <= 0) return;
  HWY_DYNAMIC_DISPATCH(ExactAttentionMulti)(q, queries, begins, ends, key_rows, value_rows, head_dim, out, ws);
}

void exact_attention_group(const float* q, int group, const f16* const* key_rows, const f16* const* value_rows,
                           std::int64_t n_ctx, int head_dim, float* out, ExactWorkspace& ws) {
  if (group <= 0) return;
  // ws.begins and ws.ends are read only by the dispatch below, which keeps its own buffers apart.
  ws.begins.assign(static_cast<std::size_t>(group), 0);
  ws.ends.assign(static_cast<std::size_t>(group), n_ctx);
  exact_attention_multi(q, group, ws.begins.data(), ws.ends.data(), key_rows, value_rows, head_dim, out, ws);
}

void exact_attention_multi(const float* q, int queries, const std::int64_t* begins, const std::int64_t* ends,
                           const f16* const* key_rows, const f16* const* value_rows, int head_dim, float* out) {
  exact_attention_multi(q, queries, begins, ends, key_rows, value_rows, head_dim, out, thread_workspace());
}

void exact_attention_group(const float* q, int group, const f16* const* key_rows, const f16* const* value_rows,
                           std::int64_t n_ctx, int head_dim, float* out) {
  exact_attention_group(q, group, key_rows, value_rows, n_ctx, head_dim, out, thread_workspace());
}

}  // namespace witcert::attention
#endif  // HWY_ONCE
