// Tier B: the sub-Gaussian certificate for the subtractively dithered INT8 cache (paper §4.2,
// Lemma 2) and its request-level failure budget.
#pragma once

#include <cstdint>
#include <span>

#include "base/fp16.h"

namespace witcert::cert {

// δ_loc = δ_req / (L·H·T): a request of L layers, H query heads and a decode budget of T steps
// fails with probability at most δ_req by the union bound. Throws std::invalid_argument unless
// 0 < δ_req < 1 and L, H, T ≥ 1.
double delta_loc(double delta_req, long layers, long q_heads, long steps);

inline constexpr long kDefaultDecodeBudget = 256;  // T
inline constexpr double kDefaultDeltaReq = 1e-2;

// Variance proxy of the logit error (Lemma 2): ς_t² = (sm²/12) Σ_{c non-outlier} q_c² s_{g(c),t}²,
// with s the token's stored fp16 group scales (group g(c) = c / group). Outlier channels are
// stored exactly and contribute nothing. An infinite scale yields +inf.
double dither_variance_proxy(std::span<const float> q, std::span<const f16> scales,
                             std::span<const std::uint8_t> outlier, int group, double sm);

// The radius that replaces c_t in Theorem 1: with probability ≥ 1 − δ_loc jointly over the S
// tokens, |ε_t| ≤ u_t where
//   u_t = sqrt(2 ς_t² log(2S/δ_loc)) + β_t,   β_t = 2^-17 · sqrt(12·D) · ς_t,
// and D is the number of non-outlier channels. β_t covers two deterministic per-channel terms
// that Lemma 2 does not see: the dither lies on a 2^-24 grid, so the rounding residual is
// uniform on 2^24 equally spaced points with mean within 2^-25·s of zero (its centred part is
// still sub-Gaussian with proxy s²/12); and the decoded key is rounded to float, adding at most
// 127.5·2^-24·s. Together ≤ 2^-17·s per channel; Cauchy–Schwarz over the D channels gives β_t
// (docs/tier-b.md).
double subgaussian_radius(double varsigma2, long S, double delta_loc, int non_outlier_channels);

}  // namespace witcert::cert
