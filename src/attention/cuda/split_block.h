// The split-KV decode attention of one (sequence, KV head, split) as one thread block computes it:
// a sequence of phases, each a loop body over the block's threads, separated by barriers. The CUDA
// kernel runs a phase on every thread and then __syncthreads(); the host tests run it for every
// thread id in turn (split_block_test.cc), so the kernel's arithmetic and its order of sums are
// checked on any machine. All of a phase's state lives in the block's shared memory (Shared).
//
// Per tile of kTile positions: locate and decode the keys and values once for the GQA group; the
// logits z̃_t of every query head (double, the scalar reference's order) and c_t (Lemma 2's ς_t²
// from the query's group sums, key_bound_grouped); per head the tile's maxima; per token the
// weight e^{z̃_t − m} and its terms of the meter's log-sum-exps; then the output accumulators (the
// tile's products in float, added to double accumulators), Σ e^{z̃_t − m}, Σ e^{z̃_t − m} ρ_t and
// the tile's meter statistics (tile_stats).
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention/cuda/meter_stats.h"
#include "attention/cuda/pool_view.h"

namespace witcert::cuda {

inline constexpr int kTile = 32;     // tokens per tile: one per lane of a head's warp
inline constexpr int kMaxGroup = 8;  // query heads per KV head a block serves
inline constexpr int kMaxHeadDim = 256;

// The block's threads: one warp per query head of the group.
WITCERT_HD int block_threads(int group) { return kTile * group; }

// The step's outputs and the split partials between the two kernels, all caller-owned device
// buffers (Workspace in attention.h).
struct StepBuffers {
  HeadState* states = nullptr;  // [seq][q head][split]
  double* acc = nullptr;        // [seq][q head][split][d]: Σ e^{z̃_t − m} v̂_t
  float* out = nullptr;         // [seq][q head][d]
  HeadReport* reports = nullptr;  // [seq][q head]
};

// Views into the block's shared memory; carve() lays them out in one buffer of shared_bytes().
struct Shared {
  double* q_norm;     // [group][bands]
  double* q2;         // [group][d/32] Q_g of dither-int8's ς_t²
  double* z;          // [group][kTile]
  double* c;          // [group][kTile]
  double* w;          // [group][kTile] e^{z̃_t − m}, 0 for a token that adds no weight
  float* wf;          // [group][kTile] the same rounded to float, for the output's products
  double* rho;        // [kTile]
  double* v_norm;     // [kTile]
  double* scale;      // [group] the factor that moves the accumulators to this tile's max
  double* acc;        // [group][d]
  TileTerms* terms;   // [group][kTile]
  TileMax* tile_max;  // [group]
  HeadState* head;    // [group]
  TokenAt* tok;       // [kTile]
  unsigned char* moment;  // [kTile] 1: a moment token (a shared-ξ dither-int8 key)
  float* q;           // [group][d]
  float* k;           // [kTile][d + 1] (padded: the logit phase reads a row per lane)
  float* v;           // [kTile][d]
};

WITCERT_HD std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }

// Lays the views out from `base` (16-byte aligned); returns the bytes they take.
WITCERT_HD std::size_t carve(unsigned char* base, int group, int d, int bands, Shared* s) {
  std::size_t at = 0;
  const auto take = [&](std::size_t bytes) {  // no pointer arithmetic on a null base (shared_bytes)
    unsigned char* p = base == nullptr ? nullptr : base + at;
    at += align16(bytes);
    return p;
  };
  const std::size_t G = static_cast<std::size_t>(group), T = kTile, D = static_cast<std::size_t>(d);
  Shared v;
  v.q_norm = reinterpret_cast<double*>(take(G * bands * sizeof(double)));
  v.q2 = reinterpret_cast<double*>(take(G * (D / kGroup) * sizeof(double)));
  v.z = reinterpret_cast<double*>(take(G * T * sizeof(double)));
  v.c = reinterpret_cast<double*>(take(G * T * sizeof(double)));
  v.w = reinterpret_cast<double*>(take(G * T * sizeof(double)));
  v.wf = reinterpret_cast<float*>(take(G * T * sizeof(float)));
  v.rho = reinterpret_cast<double*>(take(T * sizeof(double)));
  v.v_norm = reinterpret_cast<double*>(take(T * sizeof(double)));
  v.scale = reinterpret_cast<double*>(take(G * sizeof(double)));
  v.acc = reinterpret_cast<double*>(take(G * D * sizeof(double)));
  v.terms = reinterpret_cast<TileTerms*>(take(G * T * sizeof(TileTerms)));
  v.tile_max = reinterpret_cast<TileMax*>(take(G * sizeof(TileMax)));
  v.head = reinterpret_cast<HeadState*>(take(G * sizeof(HeadState)));
  v.tok = reinterpret_cast<TokenAt*>(take(T * sizeof(TokenAt)));
  v.moment = take(T);
  v.q = reinterpret_cast<float*>(take(G * D * sizeof(float)));
  v.k = reinterpret_cast<float*>(take(T * (D + 1) * sizeof(float)));
  v.v = reinterpret_cast<float*>(take(T * D * sizeof(float)));
  if (s != nullptr) *s = v;
  return at;
}

WITCERT_HD std::size_t shared_bytes(int group, int d, int bands) { return carve(nullptr, group, d, bands, nullptr); }

// One block's work and the phases it runs, in order: begin, norms (Meter), then per tile: locate,
// decode, logits, maxima, weights, accumulate; finally end.
template <bool Meter>
struct SplitBlock {
  PoolView pool;
  BatchView batch;
  StepBuffers out;
  Shared s;
  int seq = 0, kv_head = 0, split = 0, splits = 1;
  int group = 1, d = 0, threads = 32, stream = 0;
  std::int64_t begin_pos = 0, end_pos = 0;  // the split's positions
  std::int64_t t0 = 0;                      // the current tile's first position
  int tile_n = 0;                           // its positions

  WITCERT_HD SplitBlock(const PoolView& p, const BatchView& b, const StepBuffers& o, const Shared& sh, int seq_, int kv_head_,
                        int split_, int splits_)
      : pool(p), batch(b), out(o), s(sh), seq(seq_), kv_head(kv_head_), split(split_), splits(splits_) {
    group = b.group;
    d = p.d;
    threads = block_threads(group);
    stream = b.layer * p.kv_heads + kv_head;
    // Splits of whole tiles: split i of a sequence of n positions takes [i·chunk, (i + 1)·chunk).
    const std::int64_t n = b.n_ctx[seq];
    const std::int64_t per = (n + splits - 1) / splits;
    const std::int64_t chunk = (per + kTile - 1) / kTile * kTile;
    begin_pos = split * chunk < n ? split * chunk : n;
    end_pos = begin_pos + chunk < n ? begin_pos + chunk : n;
    t0 = begin_pos;
  }

  // seq·q_heads + q head of the group's head h: the query heads of KV head g are [g·group, (g+1)·group).
  WITCERT_HD std::int64_t head_index(int h) const {
    return (static_cast<std::int64_t>(seq) * pool.kv_heads + kv_head) * group + h;
  }

  // The queries of the group, empty head states and accumulators.
  WITCERT_HD void begin(int tid) {
    const float* q = batch.q + head_index(0) * d;
    for (int i = tid; i < group * d; i += threads) {
      s.q[i] = q[i];
      s.acc[i] = 0.0;
    }
    if (tid < group) s.head[tid] = HeadState{};
  }

  // ‖q_b‖ of every band (Theorem 2) and Q_g of every group (Lemma 2) of every head.
  WITCERT_HD void norms(int tid) {
    for (int i = tid; i < group * pool.bands; i += threads)
      s.q_norm[i] = band_norm(s.q + (i / pool.bands) * d, pool.neox, d, pool.bands, i % pool.bands);
    const int groups = d / kGroup;
    const std::int8_t* rank = batch.outlier_rank + (static_cast<std::int64_t>(seq) * batch.streams + stream) * d;
    for (int i = tid; i < group * groups; i += threads) s.q2[i] = group_q2(s.q + (i / groups) * d, rank, i % groups);
  }

  WITCERT_HD bool more_tiles() const { return t0 < end_pos; }
  WITCERT_HD void next_tile() { t0 += kTile; }

  // Where each of the tile's positions lives, its value's ρ_t, and whether it is a moment token.
  WITCERT_HD void locate(int tid) {
    tile_n = end_pos - t0 < kTile ? static_cast<int>(end_pos - t0) : kTile;
    if (tid < tile_n) {
      const TokenAt t = cuda::locate(pool, batch, seq, stream, t0 + tid);
      s.tok[tid] = t;
      s.rho[tid] = Meter ? value_rho(pool, stream, t) : 0.0;
      s.moment[tid] = t.shared && t.k_packed && pool.k.format == Format::dither_int8;
    }
  }

  // k̂_t and v̂_t of the tile's tokens into shared memory, once for the whole group.
  WITCERT_HD void decode(int tid) {
    const int quads = d / 4;
    for (int i = tid; i < tile_n * quads; i += threads) {
      const int t = i / quads, j = i % quads;
      float x[4];
      key_quad(pool, batch, seq, stream, s.tok[t], j, x);
      for (int e = 0; e < 4; ++e) s.k[t * (d + 1) + 4 * j + e] = x[e];
    }
    for (int i = tid; i < tile_n * d; i += threads) s.v[i] = value_at(pool, batch.layer, stream, s.tok[i / d], i % d);
  }

  // z̃_t (and with the meter c_t) of head tid / kTile, token tid % kTile; ‖v̂_t‖ on the first warp.
  // The sums run in the scalar reference's order.
  WITCERT_HD void logits(int tid) {
    const int h = tid / kTile, t = tid % kTile;
    const int at = h * kTile + t;
    if (t >= tile_n) {
      s.z[at] = -kInf;
      return;
    }
    const float* q = s.q + h * d;
    const float* k = s.k + t * (d + 1);
    double z;
    if constexpr (Meter) {
      double dot = 0.0;
      for (int i = 0; i < d; ++i) dot += static_cast<double>(q[i]) * k[i];
      z = batch.sm[seq] * dot;
      s.c[at] = key_bound_grouped(pool, batch, seq, stream, s.tok[t], s.q2 + h * (d / kGroup), s.q_norm + h * pool.bands);
    } else {  // without the meter: the float logits of an uncertified kernel
      float dot = 0.0f;
      for (int i = 0; i < d; ++i) dot = fmaf(q[i], k[i], dot);
      z = batch.sm[seq] * static_cast<double>(dot);
    }
    s.z[at] = z;
    if (Meter && h == 0) {
      double n2 = 0.0;
      for (int i = 0; i < d; ++i) n2 += static_cast<double>(s.v[t * d + i]) * s.v[t * d + i];
      s.v_norm[t] = sqrt(n2);
    }
  }

  // Per head: the running max m moved to the tile's, and with the meter the tile's maxima.
  WITCERT_HD void maxima(int tid) {
    if (tid >= group) return;
    const int h = tid;
    HeadState& p = s.head[h];
    double m = p.m;
    TileMax tm;
    for (int t = 0; t < tile_n; ++t) {
      const double z = s.z[h * kTile + t];
      if (is_nan(z) || is_nan(m))
        m = NAN;
      else if (z > m)
        m = z;
      if constexpr (Meter) tile_max_add(tm, z, s.c[h * kTile + t], s.moment[t] != 0);
    }
    s.scale[h] = m == p.m ? 1.0 : exp(p.m - m);
    p.m = m;
    if constexpr (Meter) s.tile_max[h] = tm;
  }

  // w_t = e^{z̃_t − m} of every head and token, 0 where z̃_t is not finite (the scalar reference
  // skips it); with the meter, the token's terms of the tile's log-sum-exps.
  WITCERT_HD void weights(int tid) {
    const int h = tid / kTile, t = tid % kTile, at = h * kTile + t;
    const double z = s.z[at];
    const double w = t < tile_n && is_finite(z) ? exp(z - s.head[h].m) : 0.0;
    s.w[at] = w;
    s.wf[at] = static_cast<float>(w);
    if constexpr (Meter)
      if (t < tile_n && s.tile_max[h].finite) s.terms[at] = token_terms(s.tile_max[h], z, s.c[at], s.moment[t] != 0);
  }

  // The output accumulators; per head l, Σ w ρ, max ‖v̂‖ + ρ and the tile's meter statistics.
  WITCERT_HD void accumulate(int tid) {
    for (int i = tid; i < group * d; i += threads) {
      const int h = i / d, c = i % d;
      float sum = 0.0f;
      for (int t = 0; t < tile_n; ++t) sum = fmaf(s.wf[h * kTile + t], s.v[t * d + c], sum);
      s.acc[i] = s.acc[i] * s.scale[h] + static_cast<double>(sum);
    }
    if (tid < group) {
      const int h = tid;
      HeadState& p = s.head[h];
      double l = 0.0, rho = 0.0;
      for (int t = 0; t < tile_n; ++t) {
        const double w = s.w[h * kTile + t];
        l += w;
        rho += w * s.rho[t];
        if (Meter && is_finite(s.z[h * kTile + t])) p.v_max = max_of(p.v_max, s.v_norm[t] + s.rho[t]);
      }
      p.l = p.l * s.scale[h] + l;
      p.rho = p.rho * s.scale[h] + rho;
      if constexpr (Meter)
        p.meter.merge(tile_stats(s.tile_max[h], s.z + h * kTile, s.c + h * kTile, s.moment, s.terms + h * kTile, tile_n));
    }
  }

  // The split's partials to the step buffers.
  WITCERT_HD void end(int tid) {
    for (int i = tid; i < group * d; i += threads) {
      const int h = i / d, c = i % d;
      out.acc[((head_index(h)) * splits + split) * d + c] = s.acc[i];
    }
    if (tid < group) out.states[head_index(tid) * splits + split] = s.head[tid];
  }
};

// The merge of a query head's split partials (attention::HeadPartial::merge in split order) and its
// report: thread 0 merges the states and records each split's factors (a, b), then every thread
// merges its channels with them.
struct MergeBlock {
  StepBuffers out;
  int splits = 1, d = 0;
  std::int64_t head = 0;  // seq·q_heads + q head
  double* factors;        // shared: [splits][2]
  HeadState* merged;      // shared: one

  WITCERT_HD void states(int tid) {
    if (tid != 0) return;
    HeadState p;
    for (int i = 0; i < splits; ++i) {
      const HeadState& o = out.states[head * splits + i];
      double a = 1.0, b = 0.0;
      if (!(o.l == 0.0 && o.m == -kInf)) {
        const double m_new = max_of(p.m, o.m);
        a = p.m == -kInf ? 0.0 : exp(p.m - m_new);
        b = exp(o.m - m_new);
        p.l = p.l * a + o.l * b;
        p.rho = p.rho * a + o.rho * b;
        p.m = m_new;
        p.v_max = max_of(p.v_max, o.v_max);
        p.meter.merge(o.meter);
      }
      factors[2 * i] = a;
      factors[2 * i + 1] = b;
    }
    *merged = p;
    out.reports[head] = finish(p);
  }

  WITCERT_HD void channels(int tid, int threads) {
    for (int c = tid; c < d; c += threads) {
      double acc = 0.0;
      for (int i = 0; i < splits; ++i)
        acc = acc * factors[2 * i] + out.acc[(head * splits + i) * d + c] * factors[2 * i + 1];
      out.out[head * d + c] = static_cast<float>(acc / merged->l);
    }
  }
};

}  // namespace witcert::cuda
