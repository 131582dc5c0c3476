#include "cert/meter.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "cert/round_up.h"
#include "cert/shapes_hd.h"

namespace witcert::cert {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A bound that came out NaN carries no information: report it as "no guarantee".
double sound(double v) { return hd::sound(v); }

}  // namespace

bool MeterStats::add_token(double z_t, double c_t) {
  if (z_t == -kInf) return false;  // p̃_t = 0 forces p_t = 0: the token cannot move any mass
  ++n;
  const double from = z.m;
  z.add(z_t);
  rescale_moments(from);
  if (!std::isnan(c_max) && !(c_t <= c_max)) c_max = c_t;  // NaN is sticky
  return true;
}

void MeterStats::add(double z_t, double c_t) {
  if (!add_token(z_t, c_t)) return;
  z_plus_c.add(z_t + c_t);
  z_minus_c.add(z_t - c_t);
}

void MeterStats::add_moment(double z_t, double c_t) {
  if (!add_token(z_t, c_t)) return;
  const double w = std::exp(z_t - z.m);  // NaN when z̃_t is +inf or NaN: no guarantee
  mom_w += w;
  mom_c1 += w * c_t;
  mom_c2 += w * c_t * c_t;
}

void MeterStats::rescale_moments(double from) {
  if (from == z.m || mom_w == 0.0) return;
  const double r = std::exp(from - z.m);
  mom_w *= r;
  mom_c1 *= r;
  mom_c2 *= r;
}

void MeterStats::merge(const MeterStats& o) {
  n += o.n;
  float_c_max = std::max(float_c_max, o.float_c_max);
  const double from = z.m;
  z.merge(o.z);
  rescale_moments(from);
  if (o.mom_w != 0.0) {
    const double r = std::exp(o.z.m - z.m);
    mom_w += o.mom_w * r;
    mom_c1 += o.mom_c1 * r;
    mom_c2 += o.mom_c2 * r;
  }
  z_plus_c.merge(o.z_plus_c);
  z_minus_c.merge(o.z_minus_c);
  if (!std::isnan(c_max) && !(o.c_max <= c_max)) c_max = o.c_max;
}

double expm1_excess_upper(double x) {
  if (std::isnan(x)) return x;
  // h(x) = Σ_{k≥0} x^k/(k + 2)!. Up to 1/8 the first eight terms plus x⁸/3.5e6, which exceeds the
  // tail x⁸/10!·(1 + x/11 + x²/132 + …) ≤ x⁸/(10!·(1 − x/11)); beyond, (expm1(x) − x)/x², whose
  // subtraction loses at most a factor expm1(x)/(expm1(x) − x) ≤ 18 of expm1's ulp. Both are raised
  // past their roundings (Horner: 9 positive steps).
  if (x <= 0.125) {
    double sum = 1.0 / 3.5e6;
    for (double factorial : {362880.0, 40320.0, 5040.0, 720.0, 120.0, 24.0, 6.0, 2.0}) sum = sum * x + 1.0 / factorial;
    return sum * (1.0 + 0x1p-48);
  }
  if (x > 709.0) return kInf;
  return (std::expm1(x) - x) / (x * x) * (1.0 + 0x1p-40);
}

double lse_rounding_margin(long n, double lse_a, double lse_b) {
  const double size = std::max(std::fabs(lse_a), std::fabs(lse_b));
  return (2.0 * static_cast<double>(n) + 4.0) * 0x1p-52 * (1.0 + size);
}

double float_weight_error(long n) {
  const double count = std::max(1.0, static_cast<double>(n));
  const double e = (0x1p-20 + 0x1p-24 * (1.0 + 0x1p-20) * std::log(count) + count * 0x1p-125) * kRoundUpMargin;
  return e / (1.0 - e) * kRoundUpMargin;
}

// Float weights (float_c_max ≥ 0). With A = Σ w_t E_t / Σ w_t (E_t = e^{c_t}) and A'' the same
// with w'_t, A'' − A = Σ_t (w'_t − w_t)(E_t − A) / Σ_t w'_t, so |A'' − A| ≤ ε·max_t |E_t − A| over
// the float tokens, ε = float_weight_error(n) (Σ w' ≥ (1 − ε̄)Σ w). Those E_t lie in [1, e^{f}]
// (f = float_c_max) and A in [1, e^{c_max}]:
//   c_max ≤ f:  |E_t − A| ≤ e^f − 1, so A ≤ A'' + ε(e^f − 1);
//   otherwise:  |E_t − A| ≤ max(e^f, A) − 1, so also A ≤ A''/(1 − ε) ≤ A''(1 + ε/(1 − ε)) may bind.
// With A'' ≥ 1, log A ≤ log A'' + δ for δ = ε(e^f − 1), or the larger of that and ε/(1 − ε).
// Likewise E_t, A⁻ ∈ (0, 1]: A⁻ ≥ A⁻'' − δ⁻ with δ⁻ = ε(1 − e^{−f}) when c_max ≤ f, else ε; and
// log A⁻ ≥ log A⁻'' − y/(1 − y), y = δ⁻/A⁻''. The kernel's E'_t only round A'' up and A⁻'' down.
namespace {
double float_weight_shift(const MeterStats& s, bool plus) {
  if (s.float_c_max < 0.0) return 0.0;
  const double eps = float_weight_error(s.n);
  if (plus) {
    const double d = eps * std::expm1(s.float_c_max);
    return (s.c_max <= s.float_c_max ? d : std::max(d, eps / (1.0 - eps))) * kRoundUpMargin;
  }
  return (s.c_max <= s.float_c_max ? -eps * std::expm1(-s.float_c_max) : eps) * kRoundUpMargin;
}
}  // namespace

// With every c_t = 0 the compressed logits are exact: A = A⁻ = 1 with no rounding at all.
// Moment tokens add their sums' bounds as one more term of LSE(z̃ ± c), at z.m. Each moment sum
// carries at most two more roundings per term than z's own sum; the margin is taken for 2n terms,
// and the bounds themselves are widened by 2^-50 for their few operations.
double MeterStats::log_A() const {
  if (c_max == 0.0) return 0.0;
  Lse sum = z_plus_c;
  if (mom_w != 0.0) sum.merge(Lse{z.m, (mom_w + mom_c1 + expm1_excess_upper(c_max) * mom_c2) * (1.0 + 0x1p-50)});
  const double a = sum.value(), b = z.value();
  const double upper = a - b + lse_rounding_margin(mom_w != 0.0 ? 2 * n : n, a, b);
  const double d = float_weight_shift(*this, true);
  return d == 0.0 ? upper : upper + d + 0x1p-52 * (1.0 + std::fabs(upper));  // the addition's rounding
}

double MeterStats::log_A_minus() const {
  if (c_max == 0.0) return 0.0;
  Lse sum = z_minus_c;
  if (mom_w != 0.0) {
    const double w = mom_w * (1.0 - 0x1p-50);
    sum.merge(Lse{z.m, w * std::exp(-(mom_c1 / w) * (1.0 + 0x1p-50)) * (1.0 - 0x1p-50)});
  }
  const double a = sum.value(), b = z.value();
  const double lower = a - b - lse_rounding_margin(mom_w != 0.0 ? 2 * n : n, a, b);
  const double d = float_weight_shift(*this, false);
  if (d == 0.0) return lower;
  const double y = d / std::exp(lower) * kRoundUpMargin;
  return y >= 1.0 ? -kInf : lower - y / (1.0 - y) * kRoundUpMargin - 0x1p-52 * (1.0 + std::fabs(lower));
}

// The shapes and the meter's clamp are cert/shapes_hd.h's, the source the CUDA kernel compiles too.
double eform_raw(double log_A) { return hd::eform_raw(log_A); }
double two_sided_raw(double log_A, double log_A_minus) { return hd::two_sided_raw(log_A, log_A_minus); }
double tanh_shape(double c_max) { return hd::tanh_shape(c_max); }
double tanh_half_shape(double c_max) { return hd::tanh_half_shape(c_max); }
double clamp_meter(double raw) { return hd::clamp_meter(raw); }

namespace {
constexpr BoundShape kShapes[] = {BoundShape::eform, BoundShape::two_sided, BoundShape::retention,
                                  BoundShape::tanh,  BoundShape::tanh_half, BoundShape::min};
}  // namespace

const char* bound_shape_name(BoundShape shape) {
  switch (shape) {
    case BoundShape::eform: return "eform";
    case BoundShape::two_sided: return "two-sided";
    case BoundShape::retention: return "retention";
    case BoundShape::tanh: return "tanh";
    case BoundShape::tanh_half: return "tanh-half";
    case BoundShape::min: return "min";
  }
  return "?";
}

const char* bound_shape_label(BoundShape shape) {
  switch (shape) {
    case BoundShape::eform: return "e-form (Theorem 1)";
    case BoundShape::two_sided: return "two-sided (Proposition 1)";
    case BoundShape::retention: return "per-token retention (Proposition 1)";
    case BoundShape::tanh: return "tanh(c_max)";
    case BoundShape::tanh_half: return "tanh(c_max/2)";
    case BoundShape::min: return "min of sound forms";
  }
  return "?";
}

BoundShape parse_bound_shape(std::string_view name) {
  for (BoundShape s : kShapes)
    if (name == bound_shape_name(s)) return s;
  throw std::invalid_argument("unknown bound shape '" + std::string(name) +
                              "' (eform, two-sided, retention, tanh, tanh-half or min)");
}

double Bounds::meter(BoundShape shape) const {
  switch (shape) {
    case BoundShape::eform: return clamp_meter(eform);
    case BoundShape::two_sided: return clamp_meter(two_sided);
    case BoundShape::retention: return clamp_meter(retention);
    case BoundShape::tanh: return clamp_meter(tanh);
    case BoundShape::tanh_half: return clamp_meter(tanh_half);
    case BoundShape::min: return meter();
  }
  return 1.0;
}

double Bounds::meter() const {
  // NaN or negative: not a bound, so the set is no guarantee.
  const double forms[] = {eform, two_sided, retention, tanh, tanh_half};
  return hd::min_meter(forms, 5);
}

namespace {

// Both passes of evaluate_logits with the logit of token t supplied by `logit`, so that
// probabilities can be read as logits log p̃_t without a copy.
template <class Logit>
double retention_pass(std::size_t n, Logit logit, std::span<const double> c, double lse_z,
                      double log_A, double log_A_minus) {
  // p_t·(e^x − 1) for x ≥ 0 without overflowing where the product itself is representable.
  auto weighted_expm1 = [](double log_p, double p, double x) {
    return x < 1.0 ? p * std::expm1(x) : std::exp(log_p + x) - p;
  };
  double sum = 0.0, arg_error = 0.0;
  for (std::size_t t = 0; t < n; ++t) {
    const double z_t = logit(t);
    const double log_p = z_t - lse_z;
    const double p_t = std::exp(log_p);
    if (p_t == 0.0) continue;  // then p_t = p̃_t e^{−ε_t}/Z is zero as well
    const double x_one = log_A + c[t], x_upper = c[t] - log_A_minus;
    const double one_sided = weighted_expm1(log_p, p_t, x_one);  // p̃_t (A e^{c_t} − 1)
    const double upper = weighted_expm1(log_p, p_t, x_upper);    // p̃_t (e^{c_t}/A⁻ − 1)
    const double lower = -p_t * std::expm1(-c[t] - log_A);        // p̃_t (1 − e^{−c_t}/A)
    sum += 0.5 * std::min(one_sided, std::max(upper, lower));  // halved early: no early overflow
    // exp turns an absolute error δ of its argument into a relative error of about δ, and δ grows
    // with the argument: z̃_t's own rounding (a logarithm, for probabilities), the subtraction's
    // in log p̃_t, x's and the sum log p̃_t + x's, each at most 2^-53 of its size.
    arg_error = std::max(arg_error, 0x1p-52 * (std::fabs(z_t) + 2.0 * std::fabs(log_p) + 2.0 * std::max(x_one, x_upper)));
  }
  // The terms' relative error: the arguments' absolute errors above plus lse_z's (at most the
  // margin of a difference of two log-sum-exps), amplified at most (e + 1)/(e − 1) < 2.2 by the
  // difference e^{log p̃ + x} − p̃ (x ≥ 1); then exp's, expm1's, the products' and the sum's own
  // roundings, a few ulps per token.
  const double lse_error = lse_rounding_margin(static_cast<long>(n), lse_z, lse_z);
  const double rel = 2.2 * (arg_error + lse_error) + (2.0 * static_cast<double>(n) + 8.0) * 0x1p-52;
  return sound(sum * (1.0 + rel));
}

template <class Logit>
Bounds evaluate_impl(std::size_t n, Logit logit, std::span<const double> c) {
  MeterStats stats;
  for (std::size_t t = 0; t < n; ++t) stats.add(logit(t), c[t]);
  const double log_A = stats.log_A();
  const double log_A_minus = stats.log_A_minus();
  Bounds b;
  if (std::isnan(log_A) || std::isnan(log_A_minus) || std::isnan(stats.c_max)) {
    b.eform = b.two_sided = b.retention = b.tanh = b.tanh_half = kInf;  // poisoned input
    return b;
  }
  b.eform = eform_raw(log_A);
  b.two_sided = two_sided_raw(log_A, log_A_minus);
  b.retention = retention_pass(n, logit, c, stats.z.value(), log_A, log_A_minus);
  b.tanh = tanh_shape(stats.c_max);
  b.tanh_half = tanh_half_shape(stats.c_max);
  return b;
}

}  // namespace

double retention_raw(std::span<const double> z, std::span<const double> c, double lse_z,
                     double log_A, double log_A_minus) {
  return retention_pass(z.size(), [&](std::size_t t) { return z[t]; }, c, lse_z, log_A,
                        log_A_minus);
}

Bounds evaluate_logits(std::span<const double> z, std::span<const double> c) {
  return evaluate_impl(z.size(), [&](std::size_t t) { return z[t]; }, c);
}

Bounds evaluate(std::span<const double> p_tilde, std::span<const double> c) {
  // log p̃ is a valid logit vector; zero-probability tokens become −inf logits and drop out.
  return evaluate_impl(p_tilde.size(), [&](std::size_t t) { return std::log(p_tilde[t]); }, c);
}

double true_tv(std::span<const double> p_tilde, std::span<const double> eps) {
  // p_t = p̃_t e^{−ε_t} / Z, computed with the largest weight factored out: M = max_t (log p̃_t − ε_t)
  // over p̃_t > 0, so the largest term is 1 and only terms negligible beside it can underflow. (M =
  // max_t −ε_t would not do: a subnormal p̃_t with ε_t ≈ −745 sets M while the other terms underflow.)
  double M = -std::numeric_limits<double>::infinity();
  for (std::size_t t = 0; t < p_tilde.size(); ++t)
    if (p_tilde[t] > 0.0) M = std::max(M, std::log(p_tilde[t]) - eps[t]);
  // p̃_t e^{−ε_t − M}: a normal p̃_t times the exponential, which cannot overflow (−ε_t − M ≤ −log
  // p̃_t < 709) and keeps p̃_t's precision; a subnormal one through its logarithm, where it could.
  const auto term = [&](std::size_t t) {
    return p_tilde[t] >= std::numeric_limits<double>::min() ? p_tilde[t] * std::exp(-eps[t] - M)
                                                            : std::exp(std::log(p_tilde[t]) - eps[t] - M);
  };
  double Z = 0.0;
  for (std::size_t t = 0; t < p_tilde.size(); ++t)
    if (p_tilde[t] > 0.0) Z += term(t);
  double tv = 0.0;
  for (std::size_t t = 0; t < p_tilde.size(); ++t)
    if (p_tilde[t] > 0.0) tv += std::fabs(term(t) / Z - p_tilde[t]);
  return 0.5 * tv;
}

double value_output_bound(double tv_k, double v_max_norm, double weighted_rho) {
  return sound(2.0 * tv_k * v_max_norm + weighted_rho);
}

double value_tier_b(double weighted_rho, double weighted_rho2, int head_dim, double delta) {
  if (!(delta > 0.0 && delta < 1.0) || head_dim <= 0) throw std::invalid_argument("value_tier_b: delta in (0, 1), head_dim > 0");
  if (!(weighted_rho2 >= 0.0 && weighted_rho >= 0.0) || !std::isfinite(weighted_rho2) || !std::isfinite(weighted_rho))
    return kInf;
  const double log_term = std::log(2.0 * head_dim) - std::log(delta);
  return sound(std::sqrt(2.0 * log_term * weighted_rho2 / 3.0) + 0x1p-14 * weighted_rho);
}

double value_meter(double weighted_rho, double v_max_norm) {
  if (weighted_rho == 0.0) return 0.0;
  return sound(weighted_rho / v_max_norm);  // v_max_norm = 0 with ρ > 0: +inf, no guarantee
}

}  // namespace witcert::cert
