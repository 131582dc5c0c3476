// The meter: sound upper bounds on TV(p, p̃) between the attention distribution over exact
// keys (p) and over compressed keys (p̃), given per-token logit-error bounds c_t ≥ |ε_t|
// (paper §3, §4.3; DESIGN §1).
//
// Everything is evaluated in the log domain from three log-sum-exps over the same pass:
//   LSE(z̃), LSE(z̃ + c), LSE(z̃ − c)   ⇒   log A = LSE(z̃+c) − LSE(z̃),  log A⁻ = LSE(z̃−c) − LSE(z̃).
// c is never truncated; a value that overflows is +inf, which is still sound ("no guarantee").
// NaN anywhere in the inputs also yields +inf, never a small number.
#pragma once

#include <span>
#include <string_view>

#include "cert/lse.h"

namespace witcert::cert {

// Log-domain statistics of one (layer, head, step) cell; merge across splits with merge().
struct MeterStats {
  Lse z;          // LSE_t(z̃_t)
  Lse z_plus_c;   // LSE_t(z̃_t + c_t)
  Lse z_minus_c;  // LSE_t(z̃_t − c_t)
  double c_max = 0.0;
  long n = 0;  // tokens with p̃_t > 0
  // The largest c_t among tokens whose weight e^{z̃_t − m} was computed in float (the fast
  // kernel's float tiles), −1 if none. Such a weight w'_t = w_t(1 + ε_t) carries
  // |ε_t| ≤ 2^-20 + 2^-24(1 + 2^-20)·|z̃_t − m|, the same w'_t in all three sums; log_A and
  // log_A_minus widen by what that can move A and A⁻ (float_weight_error).
  double float_c_max = -1.0;
  // Moment tokens (add_moment): they enter LSE(z̃) but not LSE(z̃ ± c); instead, with
  // w_t = e^{z̃_t − z.m} (LSE(z̃)'s reference point),
  //   mom_w = Σ w_t,  mom_c1 ≥ Σ w_t c_t,  mom_c2 ≥ Σ w_t c_t²,
  // and log_A, log_A_minus bound their share of A and A⁻ from these three sums and c_max:
  //   Σ w_t e^{c_t} ≤ mom_w + mom_c1 + h(c_max)·mom_c2   (e^c ≤ 1 + c + h(c_max)c² for c ≤ c_max),
  //   Σ w_t e^{−c_t} ≥ mom_w·e^{−mom_c1/mom_w}            (Jensen: e^{−c} is convex),
  // h(x) = (e^x − 1 − x)/x² (expm1_excess_upper). The fast kernel's float tiles take this form:
  // two multiply-adds per token instead of e^{±c_t}.
  double mom_w = 0.0;
  double mom_c1 = 0.0;
  double mom_c2 = 0.0;

  void add(double z_t, double c_t);
  // A moment token: the same p̃_t, its c_t only through the moment sums.
  void add_moment(double z_t, double c_t);
  void merge(const MeterStats& o);
  // log A = log Σ p̃_t e^{c_t}, rounded up, and log A⁻ = log Σ p̃_t e^{−c_t}, rounded down, by
  // a margin covering the double rounding of both log-sum-exps (lse_rounding_margin), so
  // every bound computed from them is at least its exact value. With moment tokens, the upper
  // and lower bounds above stand in for their terms.
  double log_A() const;
  double log_A_minus() const;

 private:
  // What add and add_moment share: n, LSE(z̃) (moving the moment sums with its reference point)
  // and c_max; false for a token of zero mass, which changes nothing.
  bool add_token(double z_t, double c_t);
  // The moment sums moved from reference point `from` to z.m.
  void rescale_moments(double from);
};

// An upper bound on h(x) = (e^x − 1 − x)/x² (½ at x = 0; increasing, h(x) = ∫₀¹ (1 − s)e^{xs} ds),
// +inf where it overflows, NaN for NaN. Precondition: x ≥ 0.
double expm1_excess_upper(double x);

// ε̄/(1 − ε̄), where ε̄ = 2^-20 + 2^-24(1 + 2^-20)·ln n + n·2^-125 bounds Σ_t |ε_t| w_t / Σ_t w_t for
// n float weights w'_t = w_t(1 + ε_t) with |ε_t| ≤ 2^-20 + 2^-24(1 + 2^-20)·|x_t|, x_t = z̃_t − m ≤ 0
// for the running max m of their partial (or |w'_t − w_t| ≤ 2^-125 where e^{x_t} underflows):
// Σ_t w_t·|x_t| / Σ_t w_t ≤ H(p̃) ≤ ln n because max_t x_t = 0.
double float_weight_error(long n);

// An upper bound on the rounding error of LSE(a) − LSE(b) over n terms each: the recursive sums
// carry relative error ≤ (2n)·2^-53 each, and the final additions m + log s one ulp of their size.
double lse_rounding_margin(long n, double lse_a, double lse_b);

// Theorem 1 (e-form): TV ≤ ½(A² − 1) = ½·expm1(2 log A). Unclamped: this is the raw risk score.
// Overflows to +inf only when ½(A² − 1) itself exceeds the double range.
double eform_raw(double log_A);
// Proposition 1 (two-sided): TV ≤ ½(A/A⁻ − A⁻/A) = sinh(log A − log A⁻).
double two_sided_raw(double log_A, double log_A_minus);
// Runtime-Certified shape (§6.4.2) as the paper states it: TV ≤ tanh(max_t c_t).
double tanh_shape(double c_max);
// The tighter sound variant: the log-likelihood ratio spans at most 2·c_max, so TV ≤ tanh(c_max/2).
double tanh_half_shape(double c_max);
// A sound bound reported as a meter: min(1, raw), always in [0, 1]; NaN or a negative value (not a
// bound) reads as no guarantee (1).
double clamp_meter(double raw);

// The bound shape a meter reports (DESIGN §1). Every shape is sound; `min` is the minimum of the
// sound forms the fused pass yields (e-form, two-sided, tanh(c_max/2)), which is at most the
// e-form of the paper's Theorem 1 and so not directly comparable with its coverage figures.
// `retention` needs A and A⁻ before a second pass over the tokens.
enum class BoundShape { eform, two_sided, retention, tanh, tanh_half, min };

// "eform", "two-sided", "retention", "tanh", "tanh-half", "min"; parse_bound_shape throws
// std::invalid_argument on anything else, listing the names.
const char* bound_shape_name(BoundShape shape);
BoundShape parse_bound_shape(std::string_view name);
// How a report names the shape: "min of sound forms", "e-form (Theorem 1)", ...
const char* bound_shape_label(BoundShape shape);

// Every bound shape for one cell, unclamped. The retention form needs A and A⁻ first, so it
// takes a second pass over the tokens (evaluate() below); the fused kernel reports the others.
struct Bounds {
  double eform = 0.0;      // Theorem 1, also the raw risk score
  double two_sided = 0.0;  // Proposition 1
  double retention = 0.0;  // Proposition 1, per-token form; dominates both aggregates
  double tanh = 0.0;
  double tanh_half = 0.0;

  // The minimum of the sound forms, clamped to 1.
  double meter() const;
  // The chosen shape, clamped to 1 (min: the minimum of all five); NaN or negative reads as 1.
  double meter(BoundShape shape) const;
};

// All bound shapes from logits z̃ (any additive offset) and bounds c_t ≥ |ε_t|.
// Preconditions: z.size() == c.size() ≥ 1, c_t ≥ 0.
Bounds evaluate_logits(std::span<const double> z, std::span<const double> c);
// The same from probabilities p̃ (p̃_t = 0 allowed).
Bounds evaluate(std::span<const double> p_tilde, std::span<const double> c);

// Proposition 1, per-token retention form:
//   ½ Σ_t p̃_t · min(A e^{c_t} − 1, max(e^{c_t}/A⁻ − 1, 1 − e^{−c_t}/A)).
double retention_raw(std::span<const double> z, std::span<const double> c, double lse_z,
                     double log_A, double log_A_minus);

// True TV(p, p̃) with p ∝ p̃ · e^{−ε}: the quantity every bound above must dominate.
double true_tv(std::span<const double> p_tilde, std::span<const double> eps);

// Value side (§3, §4.2): ‖y − ŷ‖ ≤ 2·TV_K·max_t‖v_t‖ + Σ_t p̃_t ρ^v_t.
double value_output_bound(double tv_k, double v_max_norm, double weighted_rho);
// The V meter: the second term relative to max_t‖v_t‖ (0 when all values are zero and exact).
double value_meter(double weighted_rho, double v_max_norm);
// Tier B on the value side (docs/tier-b.md, "Values"): for values quantized with a dither of
// their own per token and channel (independent across tokens and of the weights p̃), with
// probability at least 1 − δ
//   ‖Σ_t p̃_t (v̂_t − v_t)‖ ≤ sqrt(2·ln(2d/δ)·Σ_t p̃_t² ρ_t² / 3) + 2^-14·Σ_t p̃_t ρ_t,
// where ρ_t ≥ ½·sqrt(Σ_c s_{t,c}²) is the token's sure bound: channel c's error is s·U plus a
// deterministic part below 2^-15·s, U centred with variance proxy 1/12, so the channel's sum is
// sub-Gaussian with proxy Σ_t p̃_t² s_{t,c}²/12 and a union over the d channels bounds the norm.
// weighted_rho = Σ p̃_t ρ_t, weighted_rho2 = Σ p̃_t² ρ_t²; +inf when either is not finite. The sure
// Σ p̃_t ρ_t holds too, so the smaller of the two holds with probability at least 1 − δ.
double value_tier_b(double weighted_rho, double weighted_rho2, int head_dim, double delta);

}  // namespace witcert::cert
