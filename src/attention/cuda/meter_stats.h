// The meter's statistics for host and device: cert::Lse and cert::MeterStats written as WITCERT_HD
// code that reproduces the cert layer's arithmetic operation for operation (meter_stats_test.cc
// holds them to it bit for bit), and attention::finish on the cert layer's bound shapes, which are
// shared source (cert/shapes_hd.h). The CUDA kernel sums each tile's terms from the tile's maxima
// and merges the tiles (tile_stats); the cert layer's margins cover any order of the sums
// (docs/cuda.md).
#pragma once

#include "attention/cuda/hd.h"
#include "cert/shapes_hd.h"

namespace witcert::cuda {

// cert::Lse: LSE_t(x_t) = m + log s.
struct Lse {
  double m = -kInf;
  double s = 0.0;

  WITCERT_HD void add(double x) {
    if (is_nan(x) || is_nan(m)) {
      m = NAN;
      return;
    }
    if (x == -kInf) return;
    if (x == kInf || m == kInf) {
      m = kInf;
      s = 1.0;
      return;
    }
    if (x <= m) {
      s += exp(x - m);
    } else {
      s = s * exp(m - x) + 1.0;
      m = x;
    }
  }

  WITCERT_HD void merge(const Lse& o) {
    if (is_nan(o.m) || is_nan(m)) {
      m = NAN;
      return;
    }
    if (o.s == 0.0) return;
    if (s == 0.0 || o.m == kInf) {
      *this = o;
      return;
    }
    if (m == kInf) return;
    if (o.m <= m) {
      s += o.s * exp(o.m - m);
    } else {
      s = s * exp(m - o.m) + o.s;
      m = o.m;
    }
  }

  WITCERT_HD double value() const { return s == 0.0 && !is_nan(m) ? m : m + log(s); }
};

// h(x) = (e^x − 1 − x)/x², rounded up: cert::expm1_excess_upper.
WITCERT_HD double expm1_excess_upper(double x) {
  if (is_nan(x)) return x;
  if (x <= 0.125) {
    const double factorials[] = {362880.0, 40320.0, 5040.0, 720.0, 120.0, 24.0, 6.0, 2.0};
    double sum = 1.0 / 3.5e6;
    for (double factorial : factorials) sum = sum * x + 1.0 / factorial;
    return sum * (1.0 + 0x1p-48);
  }
  if (x > 709.0) return kInf;
  return (expm1(x) - x) / (x * x) * (1.0 + 0x1p-40);
}

// cert::lse_rounding_margin.
WITCERT_HD double lse_rounding_margin(long long n, double lse_a, double lse_b) {
  const double size = max_of(fabs(lse_a), fabs(lse_b));
  return (2.0 * static_cast<double>(n) + 4.0) * 0x1p-52 * (1.0 + size);
}

// cert::MeterStats without float weights (the GPU computes every weight in double, so
// float_c_max stays −1 and log_A needs no float_weight_shift).
struct MeterStats {
  Lse z, z_plus_c, z_minus_c;
  double c_max = 0.0;
  long long n = 0;
  double mom_w = 0.0, mom_c1 = 0.0, mom_c2 = 0.0;

  WITCERT_HD void add(double z_t, double c_t) {
    if (!add_token(z_t, c_t)) return;
    z_plus_c.add(z_t + c_t);
    z_minus_c.add(z_t - c_t);
  }

  WITCERT_HD void add_moment(double z_t, double c_t) {
    if (!add_token(z_t, c_t)) return;
    const double w = exp(z_t - z.m);
    mom_w += w;
    mom_c1 += w * c_t;
    mom_c2 += w * c_t * c_t;
  }

  WITCERT_HD void merge(const MeterStats& o) {
    n += o.n;
    const double from = z.m;
    z.merge(o.z);
    rescale_moments(from);
    if (o.mom_w != 0.0) {
      const double r = exp(o.z.m - z.m);
      mom_w += o.mom_w * r;
      mom_c1 += o.mom_c1 * r;
      mom_c2 += o.mom_c2 * r;
    }
    z_plus_c.merge(o.z_plus_c);
    z_minus_c.merge(o.z_minus_c);
    if (!is_nan(c_max) && !(o.c_max <= c_max)) c_max = o.c_max;
  }

  WITCERT_HD double log_A() const {
    if (c_max == 0.0) return 0.0;
    Lse sum = z_plus_c;
    if (mom_w != 0.0) sum.merge(Lse{z.m, (mom_w + mom_c1 + expm1_excess_upper(c_max) * mom_c2) * (1.0 + 0x1p-50)});
    const double a = sum.value(), b = z.value();
    return a - b + lse_rounding_margin(mom_w != 0.0 ? 2 * n : n, a, b);
  }

  WITCERT_HD double log_A_minus() const {
    if (c_max == 0.0) return 0.0;
    Lse sum = z_minus_c;
    if (mom_w != 0.0) {
      const double w = mom_w * (1.0 - 0x1p-50);
      sum.merge(Lse{z.m, w * exp(-(mom_c1 / w) * (1.0 + 0x1p-50)) * (1.0 - 0x1p-50)});
    }
    const double a = sum.value(), b = z.value();
    return a - b - lse_rounding_margin(mom_w != 0.0 ? 2 * n : n, a, b);
  }

 private:
  WITCERT_HD bool add_token(double z_t, double c_t) {
    if (z_t == -kInf) return false;
    ++n;
    const double from = z.m;
    z.add(z_t);
    rescale_moments(from);
    if (!is_nan(c_max) && !(c_t <= c_max)) c_max = c_t;
    return true;
  }

  WITCERT_HD void rescale_moments(double from) {
    if (from == z.m || mom_w == 0.0) return;
    const double r = exp(from - z.m);
    mom_w *= r;
    mom_c1 *= r;
    mom_c2 *= r;
  }
};

// A tile's share of the meter, in three steps that a thread block runs as phases (split_block.h):
// the reference points of its log-sum-exps (TileMax, per head), each token's terms (token_terms, in
// parallel) and their sums (tile_stats). For finite z̃_t and c_t the result is the MeterStats of
// the tokens added one by one, up to the order of the sums, which lse_rounding_margin covers; a
// tile that holds a non-finite z̃_t or c_t is added token by token instead, for the cert layer's
// rules on −inf, +inf and NaN. A moment token (shared-ξ key) enters LSE(z̃) and the moment sums
// only, as in add_moment.
struct TileMax {
  double z = -kInf, plus = -kInf, minus = -kInf;  // max z̃_t, max z̃_t + c_t, max z̃_t − c_t
  bool finite = true;
};

WITCERT_HD void tile_max_add(TileMax& m, double z, double c, bool moment) {
  m.finite = m.finite && is_finite(z) && is_finite(c);
  m.z = max_of(m.z, z);
  if (moment) return;
  m.plus = max_of(m.plus, z + c);
  m.minus = max_of(m.minus, z - c);
}

struct TileTerms {
  double e_z, e_plus, e_minus;  // e^{z̃_t − max}, and e^{z̃_t ± c_t − max} (0 for a moment token)
};

WITCERT_HD TileTerms token_terms(const TileMax& m, double z, double c, bool moment) {
  if (moment) return {exp(z - m.z), 0.0, 0.0};
  return {exp(z - m.z), exp(z + c - m.plus), exp(z - c - m.minus)};
}

// The tile's MeterStats from its n tokens' logits z, bounds c, moment flags and terms.
WITCERT_HD MeterStats tile_stats(const TileMax& m, const double* z, const double* c, const unsigned char* moment,
                                 const TileTerms* terms, int n) {
  MeterStats t;
  if (!m.finite) {
    for (int i = 0; i < n; ++i) {
      if (moment[i])
        t.add_moment(z[i], c[i]);
      else
        t.add(z[i], c[i]);
    }
    return t;
  }
  double sz = 0.0, sp = 0.0, sm = 0.0;
  for (int i = 0; i < n; ++i) {
    sz += terms[i].e_z;
    if (moment[i]) {
      const double w = terms[i].e_z;  // add_moment's products, in its order
      t.mom_w += w;
      t.mom_c1 += w * c[i];
      t.mom_c2 += w * c[i] * c[i];
    } else {
      sp += terms[i].e_plus;
      sm += terms[i].e_minus;
    }
    t.c_max = max_of(t.c_max, c[i]);
  }
  t.n = n;
  if (n > 0) t.z = {m.z, sz};
  if (sp > 0.0) t.z_plus_c = {m.plus, sp};
  if (sm > 0.0) t.z_minus_c = {m.minus, sm};
  return t;
}

// The bound shapes and the meter's clamp: the cert layer's own functions (cert/shapes_hd.h), which
// nvcc compiles for the device too, edges included (first-order bounds near the subnormal range; a
// NaN or negative bound reads as no guarantee).
using cert::hd::clamp_meter;
using cert::hd::eform_raw;
using cert::hd::min_meter;
using cert::hd::sound;
using cert::hd::tanh_half_shape;
using cert::hd::tanh_shape;
using cert::hd::two_sided_raw;

// One query head's partial over a token range: attention::HeadPartial with the output accumulator kept
// apart (the kernel holds it per channel).
struct HeadState {
  double m = -kInf;      // running max of z̃
  double l = 0.0;        // Σ e^{z̃_t − m}
  double rho = 0.0;      // Σ e^{z̃_t − m} ρ^v_t
  double v_max = 0.0;    // max_t (‖v̂_t‖ + ρ^v_t)
  MeterStats meter;
};

// What attention::finish reports for the `min` shape, the default.
struct HeadReport {
  double eform_raw = 0.0, meter = 0.0, v_meter = 0.0, output_bound = 0.0;
  double log_A = 0.0, log_A_minus = 0.0;
};

// attention::finish's meters from a merged head state (the output is acc / l, written by the caller).
WITCERT_HD HeadReport finish(const HeadState& p) {
  HeadReport r;
  r.log_A = p.meter.log_A();
  r.log_A_minus = p.meter.log_A_minus();
  r.eform_raw = eform_raw(r.log_A);
  const double two_sided = two_sided_raw(r.log_A, r.log_A_minus);
  const double th = tanh_shape(p.meter.c_max), th_half = tanh_half_shape(p.meter.c_max);
  // Bounds::meter(): the minimum of the sound forms, the retention form read as the e-form; a NaN
  // or negative form makes it no guarantee (1).
  const double forms[] = {r.eform_raw, two_sided, r.eform_raw, th, th_half};
  r.meter = is_nan(r.log_A) || is_nan(p.m) ? 1.0 : min_meter(forms, 5);
  const double weighted_rho = p.rho / p.l;
  r.v_meter = weighted_rho == 0.0 ? 0.0 : sound(weighted_rho / p.v_max);
  r.output_bound = sound(2.0 * r.meter * p.v_max + weighted_rho);
  if (is_nan(p.m) || !(p.l > 0.0)) {
    r.eform_raw = kInf;
    r.meter = 1.0;
    r.v_meter = kInf;
    r.output_bound = kInf;
  }
  return r;
}

}  // namespace witcert::cuda
