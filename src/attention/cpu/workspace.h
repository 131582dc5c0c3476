// The buffers of the fused decode attention (attend.h), owned by the caller and reused from call
// to call: a call sizes them with vector::assign, which keeps the capacity, so that once a
// workspace has served the largest (group, head_dim) it will see, a call allocates nothing.
// Not shared between threads: one workspace per thread (a thread_local at the call site).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/fp16.h"
#include "kvcache/kv_store.h"

namespace witcert::kernel {

struct Workspace {
  // One decoded block of a scheme that packs T tokens together, kept while the tile reads it.
  struct BlockCache {
    std::int64_t block = -1;
    std::vector<float> decoded;
  };
  // A group scheme's block split for its SIMD decoder (attention/cpu/group-inl.h), channels in lanes.
  struct GroupBlock {
    std::vector<f16> s16, lo16;        // [c] the records' fp16 step and minimum
    std::vector<float> s, lo;          // [c] the same as floats, zero past the head dimension
    std::vector<std::uint32_t> words;  // [w][c] the codes, 32/b tokens a word
    std::size_t dp = 0;                // lanes of a row
  };
  // Where a lane block of shared-ξ key codes lies: channel c's kNF codes at codes + c·stride.
  struct CodeBlock {
    const std::int8_t* codes = nullptr;
    std::size_t stride = 0;
  };
  // The part of a tile that lies in one page.
  struct Segment {
    kvcache::KvStore::Reader::RawPage page;
    std::size_t row0;  // the segment's first row in the page
    int i0, n;         // its first token in the tile, its tokens
  };

  // Per call: the query heads and the constants of their bounds.
  struct Query {
    std::vector<double> qd;     // [h][dp] q as double
    std::vector<double> eta_q;  // [h] η_t/‖k̂_t‖ (Tier A)
    std::vector<double> eta_g;  // [h][G] sm·(d + 64)·2^-52·128·‖q_g‖₁: η_t = Σ_g eta_g·s_{g,t} + eta_x·Σ|x_out| (Tier B)
    std::vector<double> eta_x;  // [h] sm·(d + 64)·2^-52·max_{outlier c}|q_c|
    std::vector<double> qn;     // [h][B] ‖q_b‖ (Tier A)
    std::vector<double> q2;     // [h][G] Σ_{c∈g, non-outlier} q_c² (Tier B)
    std::vector<double> qbar;   // [h][dp] q with the outlier channels zeroed
    std::vector<float> qbar_f;  // [h][dp] the same in float (float tiles)
    std::vector<int> outliers;  // the outlier channels
    std::vector<float> qbarf;   // q̄ per head block of CodeDots, [c][heads]
    std::vector<float> q_out;   // [h][2m] q at the outlier channels
    std::vector<float> eta_gf;  // [h][G] η's coefficient of s_g on float tiles (ScalarTile)
    std::vector<float> eta_xf;  // [h]
    std::vector<float> cq2f;    // [h][G] LogitsFloat's (sm²/12)·κ²·Σ q_c², times (1 + 2^-17)²
    std::vector<float> ceta_gf, ceta_xf;  // EtaBound's: η's coefficients times 1 + 2^-17
  } query;

  // Per tile: the decoded keys and what bounds their logit error, in token lanes.
  struct Keys {
    std::vector<double> krows;          // [t][dp] k'_t
    std::vector<float> kfloat;          // one decoded scheme key
    std::vector<float> kfrows;          // [t][dp] k̂_t of packed keys
    std::vector<std::int8_t> key_row;   // [c] one dither-int8 key's codes, gathered from its page
    std::vector<float> xi;              // ξ of the token (per-slot) or of the page (shared)
    std::vector<std::uint32_t> words;   // Philox output words behind xi
    std::vector<double> w_band;         // [b][t] witness (Tier A)
    std::vector<double> band_row;       // one token's witness
    std::vector<double> mu;             // [t] ‖k̂_t‖ (Tier A)
    std::vector<double> s, s2;          // [g][t] dither scale and its square
    std::vector<double> scales;         // [t][g] the tile's key scales
    std::vector<double> outlier_values; // [t][2m] the tile's outlier values
    std::vector<double> x_out;          // [t] Σ_{outlier c} |x_{t,c}| (Tier B)
    // Shared-ξ dither-int8 keys (float tiles).
    std::vector<CodeBlock> code_blocks;  // [b] the tile's key codes, tokens in lanes
    std::vector<std::int8_t> tail_codes; // [c][lane] a lane block that would read past its page
    std::vector<float> outliers_t;       // [b][j][lane] the tile's outlier values, tokens in lanes
    std::vector<float> code_dots;        // [h][g][t] Σ_{c∈g} q̄_c·code_{t,c}
    std::vector<float> meta_f;           // [t][g] the tile's key scales, as stored
    std::vector<float> outliers_f;       // [t][j] the tile's outlier values, as stored
    std::vector<float> sf, s2f;          // [g][t] the tile's key scales and their squares
    std::vector<float> poison;           // [t] NaN where the token's scale or outlier values are not finite, else 0
    std::vector<float> tile_s2_max;      // [g] the tile's largest s_g² (KeyTileFloat)
    std::vector<float> key_s2_max;       // [g] the float tiles' largest s_g² in the call so far
    std::vector<float> x_out_max;        // [lane] and their largest Σ|x_out|
    std::vector<float> qgf;              // [segment][h][G] Q_g of the segment's page
    std::vector<int> block_segment;      // [b] the segment of lane block b
    std::vector<std::int64_t> page_counter;  // [segment] the shared-ξ counter word qgf's slot belongs to
    std::vector<f16> key_meta_buf, key_outliers_buf;  // a tile of several pages: its scales and outlier values
    BlockCache block;                    // a group scheme's decoded block
    GroupBlock group;                    // a group scheme's block for its SIMD decoder
  } keys;

  // Per tile: the decoded values, ρ_t and ‖v̂_t‖ in token lanes.
  struct Values {
    std::vector<float> vrows;      // [t][dp] v̂_t
    std::vector<float> v_scalesf;  // [t][g] the tile's value scales (dither-int8)
    std::vector<float> v_s_tf;     // [g][t] the same, token lanes
    std::vector<float> v_rho_f;    // [t] ρ_t in float
    std::vector<float> ws;         // [head][group of the pass][t] w_t·s_{t,g} (AccumulateCodeColumns)
    std::vector<float> xi;         // [c] one token's value dither (dithered values, KvStore::value_dither)
    std::vector<std::uint32_t> words;  // [c] its Philox words
    std::vector<float> code_sq;    // [g][t][kNF] lane sums of the value codes' squares (float rows)
    std::vector<float> code_sum;   // [g][t] C_{t,g} = Σ_{c∈g} code_c²
    std::vector<double> rho, vnorm;  // [t] ρ^v_t, ‖v̂_t‖
    BlockCache block;              // a group scheme's decoded block
  } values;

  // Per tile and query head: logits, bounds and weights.
  struct Logits {
    std::vector<double> z, c;      // [h][t] z̃_t and c_t
    std::vector<float> zf, cf;     // [h][t] z̃_t (LogitsFloat) and a_t (Radii) of float tiles
    std::vector<double> z_max;     // [h] the tile's max z̃_t (LogitsFloat)
    std::vector<float> xf;         // [t] z̃_t − m
    std::vector<float> w;          // [h][t] e^{z̃_t − m}
    std::vector<double> rescale;   // [h] factor on the output from this tile's new max
    std::vector<char> scalar;      // [h] the tile went through ScalarTile
    std::vector<char> finite;      // [h] every z̃_t, z̃_t ± c_t of the tile is finite
  } logits;

  // Per query head, across the call's tiles: the output and the sums not yet in the partial.
  struct Heads {
    std::vector<double> acc;          // [h][dp] Σ e^{z̃_t − m} v̂_t
    std::vector<double> pending;      // [h][Pending][lane] sums not yet in the partial
    std::vector<float> chains;        // [h][kChainCount][kNF] UpdateFloat's running X1, X2 and X3 chains
    std::vector<int> chain_steps;     // [h] their rounding steps since the last Flush
    std::vector<float> chain_a_max;   // [h][lane] max a_t over their tokens
    // [h] the pending kL holds weights of a tile that was not a float tile's (Update): UpdateFloat
    // flushes it before a chain starts, so that a chain's Σ w'_t is the pending kL.
    std::vector<std::uint8_t> l_mixed;
  } heads;

  std::vector<Segment> segments;  // the tile's pages, in order
  // Pages of dithered codes below 8 bits, unpacked to one int8 a code as the kernel reads them: a
  // ring that holds at least the pages of the current tile and the page before it.
  std::vector<std::int8_t> unpacked;
  std::size_t unpacked_at = 0;
  int head_dim = 0;  // of the last call: the row buffers' padding channels are zero for it
};

}  // namespace witcert::kernel
