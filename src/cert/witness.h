// Tier A: the band-norm witness of a black-box cache-preserving scheme (paper §4.1).
//
// The d/2 RoPE frequency pairs are grouped into B contiguous bands of d/(2B) pairs. Which
// coordinates form pair j depends on the model's RoPE layout, so the band map is a function
// of it: a pair split across two bands would break Lemma 1.
#pragma once

#include <span>

#include "base/fp16.h"
#include "cert/round_up.h"

namespace witcert::cert {

enum class RopeLayout {
  interleaved,  // pair j = (2j, 2j+1): GGML's "normal" rope (llama)
  neox,         // pair j = (j, j + d/2): NeoX half-split
};

struct RopePair {
  int lo, hi;
};

// Coordinates of frequency pair j of a d-dimensional head.
RopePair rope_pair(RopeLayout layout, int d, int j);

// A band layout: d even, B ≥ 1 dividing d/2. Invalid shapes throw std::invalid_argument.
struct BandLayout {
  int d;
  int bands;
  RopeLayout layout;

  BandLayout(int d, int bands, RopeLayout layout);
  int pairs_per_band() const { return d / (2 * bands); }
  // Coordinate i of band b (0 ≤ i < 2·pairs_per_band()).
  int coordinate(int b, int i) const;
};

inline constexpr int kDefaultBands = 16;

// Witness (2): w_{t,b} = ‖r_{t,b}‖ with r_t = k̂_t − k_t, stored fp16 rounded up so that
// w_{t,b} ≥ ‖r_{t,b}‖ holds for the stored value. Output: one fp16 per band.
void tier_a_witness(const BandLayout& bl, std::span<const float> k_hat, std::span<const float> k,
                    std::span<f16> w);

// ‖q_b‖ for every band, rounded up by a margin covering double rounding.
void band_norms(const BandLayout& bl, std::span<const float> q, std::span<double> q_norm);

// Theorem 2: c_t = sm · Σ_b ‖q_b‖ · w_{t,b} ≥ |ε_t|, rounded up by a margin covering the double
// rounding of the sum. A band with ‖q_b‖ = 0 contributes 0 even if its witness is +inf.
double tier_a_c(std::span<const double> q_norm, std::span<const f16> w, double sm);

}  // namespace witcert::cert
