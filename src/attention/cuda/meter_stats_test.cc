// The meter's statistics of the CUDA kernel (meter_stats.h), run on the host: bit for bit the cert
// layer's in the scalar order, and sound in the kernel's merge order.
#include "attention/cuda/meter_stats.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <boost/multiprecision/cpp_bin_float.hpp>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention/reference/certified_attention.h"
#include "cert/meter.h"

namespace witcert::cuda {
namespace {

bool same_bits(double a, double b) { return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b) || (a != a && b != b); }

void expect_same(const MeterStats& g, const cert::MeterStats& c) {
  EXPECT_TRUE(same_bits(g.z.m, c.z.m) && same_bits(g.z.s, c.z.s));
  EXPECT_TRUE(same_bits(g.z_plus_c.m, c.z_plus_c.m) && same_bits(g.z_plus_c.s, c.z_plus_c.s));
  EXPECT_TRUE(same_bits(g.z_minus_c.m, c.z_minus_c.m) && same_bits(g.z_minus_c.s, c.z_minus_c.s));
  EXPECT_TRUE(same_bits(g.c_max, c.c_max));
  EXPECT_EQ(g.n, c.n);
  EXPECT_TRUE(same_bits(g.mom_w, c.mom_w) && same_bits(g.mom_c1, c.mom_c1) && same_bits(g.mom_c2, c.mom_c2));
  EXPECT_TRUE(same_bits(g.log_A(), c.log_A())) << g.log_A() << " vs " << c.log_A();
  EXPECT_TRUE(same_bits(g.log_A_minus(), c.log_A_minus())) << g.log_A_minus() << " vs " << c.log_A_minus();
}

struct Token {
  double z, c;
  bool moment;
};

// Logits of a few scales, bounds from 0 to beyond saturation, some moment tokens, and the special
// values the cert layer defines: −inf logits (zero mass), +inf and NaN bounds.
std::vector<Token> tokens(std::mt19937_64& rng, int n, bool special) {
  std::normal_distribution<double> g(0.0, 1.0);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<Token> t(n);
  const double spread = std::exp(2.0 * g(rng)), c_scale = std::exp(3.0 * g(rng) - 3.0);
  for (Token& x : t) x = {spread * g(rng), c_scale * u(rng), u(rng) < 0.3};
  if (special && n > 3) {
    t[1].z = -INFINITY;
    t[2].c = rng() % 2 ? INFINITY : 0.0;
  }
  return t;
}

TEST(CudaMeterStats, ScalarOrderMatchesTheCertLayerBitForBit) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 300; ++trial) {
    const std::vector<Token> ts = tokens(rng, 1 + static_cast<int>(rng() % 300), trial % 3 == 0);
    MeterStats g;
    cert::MeterStats c;
    for (const Token& t : ts) {
      if (t.moment) {
        g.add_moment(t.z, t.c), c.add_moment(t.z, t.c);
      } else {
        g.add(t.z, t.c), c.add(t.z, t.c);
      }
    }
    expect_same(g, c);
    // The same tokens split into ranges, each merged in order: the reference's split-KV.
    const std::size_t cut1 = rng() % ts.size(), cut2 = cut1 + rng() % (ts.size() - cut1);
    MeterStats gm;
    cert::MeterStats cm;
    for (const auto& [b, e] : {std::pair{std::size_t{0}, cut1}, {cut1, cut2}, {cut2, ts.size()}}) {
      MeterStats gp;
      cert::MeterStats cp;
      for (std::size_t i = b; i < e; ++i) {
        if (ts[i].moment) {
          gp.add_moment(ts[i].z, ts[i].c), cp.add_moment(ts[i].z, ts[i].c);
        } else {
          gp.add(ts[i].z, ts[i].c), cp.add(ts[i].z, ts[i].c);
        }
      }
      gm.merge(gp), cm.merge(cp);
    }
    expect_same(gm, cm);
  }
}

// The kernel's order: per tile of 32 tokens the maxima, each token's terms and their sums
// (tile_stats), merged into the running statistics tile by tile.
MeterStats tile_order(const std::vector<Token>& ts) {
  MeterStats run;
  for (std::size_t t0 = 0; t0 < ts.size(); t0 += 32) {
    const int n = static_cast<int>(std::min<std::size_t>(32, ts.size() - t0));
    double z[32], c[32];
    unsigned char moment[32];
    TileTerms terms[32];
    TileMax m;
    for (int i = 0; i < n; ++i) {
      z[i] = ts[t0 + i].z, c[i] = ts[t0 + i].c, moment[i] = ts[t0 + i].moment;
      tile_max_add(m, z[i], c[i], moment[i] != 0);
    }
    if (m.finite)
      for (int i = 0; i < n; ++i) terms[i] = token_terms(m, z[i], c[i], moment[i] != 0);
    run.merge(tile_stats(m, z, c, moment, terms, n));
  }
  return run;
}

// log A in the tile order stays within the margin of the scalar order's and above the exact log A
// (long double, moment tokens at their exact e^{±c}, which the moment bounds dominate); log A⁻ below.
TEST(CudaMeterStats, TileOrderIsWithinTheMarginAndSound) {
  std::mt19937_64 rng(2);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<Token> ts = tokens(rng, 1 + static_cast<int>(rng() % 2000), false);
    if (trial % 2 == 0)
      for (Token& t : ts) t.moment = false;
    MeterStats scalar;
    for (const Token& t : ts) {
      if (t.moment)
        scalar.add_moment(t.z, t.c);
      else
        scalar.add(t.z, t.c);
    }
    const MeterStats tiled = tile_order(ts);
    long double m = -INFINITY, sz = 0, sa = 0, sb = 0;
    for (const Token& t : ts) m = std::max<long double>(m, t.z);
    for (const Token& t : ts) {
      sz += std::exp(static_cast<long double>(t.z) - m);
      sa += std::exp(static_cast<long double>(t.z) - m + t.c);
      sb += std::exp(static_cast<long double>(t.z) - m - t.c);
    }
    const double exact_a = static_cast<double>(std::log(sa / sz)), exact_b = static_cast<double>(std::log(sb / sz));
    EXPECT_EQ(tiled.n, scalar.n);
    EXPECT_EQ(tiled.c_max, scalar.c_max);
    EXPECT_NEAR(tiled.log_A(), scalar.log_A(), 1e-12 * (1.0 + std::fabs(scalar.log_A()))) << trial;
    EXPECT_NEAR(tiled.log_A_minus(), scalar.log_A_minus(), 1e-12 * (1.0 + std::fabs(scalar.log_A_minus()))) << trial;
    EXPECT_GE(tiled.log_A(), exact_a) << trial;
    EXPECT_LE(tiled.log_A_minus(), exact_b) << trial;
  }
}

// A tile holding −inf, +inf or NaN takes the cert layer's rules: the same outcome as token by token.
TEST(CudaMeterStats, TileOrderKeepsTheRulesOfSpecialValues) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<Token> ts = tokens(rng, 4 + static_cast<int>(rng() % 100), true);
    if (trial % 3 == 0) ts[rng() % ts.size()].z = NAN;
    if (trial % 3 == 1) ts[rng() % ts.size()].z = INFINITY;
    cert::MeterStats scalar;
    for (const Token& t : ts) {
      if (t.moment)
        scalar.add_moment(t.z, t.c);
      else
        scalar.add(t.z, t.c);
    }
    const MeterStats tiled = tile_order(ts);
    EXPECT_EQ(tiled.n, scalar.n) << trial;
    EXPECT_TRUE(same_bits(tiled.c_max, scalar.c_max)) << trial;
    for (const auto& [got, want] : {std::pair{tiled.log_A(), scalar.log_A()}, {tiled.log_A_minus(), scalar.log_A_minus()}}) {
      EXPECT_EQ(std::isnan(got), std::isnan(want)) << trial;
      EXPECT_EQ(std::isinf(got), std::isinf(want)) << trial;
      if (std::isfinite(want)) {
        EXPECT_NEAR(got, want, 1e-12 * (1.0 + std::fabs(want))) << trial;
      }
    }
  }
}

TEST(CudaMeterStats, FinishMatchesAttnFinish) {
  std::mt19937_64 rng(4);
  std::normal_distribution<double> g(0.0, 1.0);
  for (int trial = 0; trial < 300; ++trial) {
    attention::HeadPartial cpu;
    HeadState gpu;
    const std::vector<Token> ts = tokens(rng, 1 + static_cast<int>(rng() % 100), trial % 4 == 0);
    for (const Token& t : ts) {
      if (t.moment) {
        cpu.meter.add_moment(t.z, t.c), gpu.meter.add_moment(t.z, t.c);
      } else {
        cpu.meter.add(t.z, t.c), gpu.meter.add(t.z, t.c);
      }
    }
    cpu.m = gpu.m = trial % 50 == 0 ? NAN : g(rng);
    cpu.l = gpu.l = trial % 60 == 1 ? 0.0 : std::exp(g(rng));
    cpu.rho = gpu.rho = trial % 3 == 0 ? 0.0 : std::exp(g(rng) - 4.0);
    cpu.v_max = gpu.v_max = trial % 70 == 2 ? 0.0 : std::exp(g(rng));
    cpu.acc.assign(4, 1.0);
    float out[4];
    const attention::HeadResult want = attention::finish(cpu, 4, out);
    const HeadReport got = finish(gpu);
    EXPECT_TRUE(same_bits(got.eform_raw, want.eform_raw)) << trial;
    EXPECT_TRUE(same_bits(got.meter, want.meter)) << trial << ": " << got.meter << " vs " << want.meter;
    EXPECT_TRUE(same_bits(got.v_meter, want.v_meter)) << trial;
    EXPECT_TRUE(same_bits(got.output_bound, want.output_bound)) << trial;
  }
}


// The shapes and the clamp are the cert layer's source (cert/shapes_hd.h): the same bits at the edges
// of double, the first-order bounds near the subnormal range included.
TEST(CudaMeterStats, ShapesMatchTheCertLayerBitForBitAtTheEdges) {
  const double tiny = std::numeric_limits<double>::denorm_min();
  const std::vector<double> xs = {0.0,      -0.0,      tiny,     2 * tiny, 3 * tiny, 5 * tiny,
                                  1e-320,   1e-310,    0x1p-1000, 0x1p-999, 1e-300,   std::nextafter(0x1p-1000, 0.0),
                                  0x1p-60,  1e-9,      0.3,       0.5,      1.0,      30.0,
                                  300.0,    354.0,     355.0,     700.0,    710.0,    1e300,
                                  kInf,     -tiny,     -1.0,      -kInf,    NAN};
  for (double x : xs) {
    SCOPED_TRACE(x);
    EXPECT_TRUE(same_bits(eform_raw(x), cert::eform_raw(x)));
    EXPECT_TRUE(same_bits(tanh_shape(x), cert::tanh_shape(x)));
    EXPECT_TRUE(same_bits(tanh_half_shape(x), cert::tanh_half_shape(x)));
    EXPECT_TRUE(same_bits(clamp_meter(x), cert::clamp_meter(x)));
    for (double y : xs) EXPECT_TRUE(same_bits(two_sided_raw(x, y), cert::two_sided_raw(x, y))) << y;
  }
}

// Fifty-digit references that keep their digits where the argument is far below 10^-50 of 1 (c_t
// subnormal): e^x − 1 and tanh through their series there, never through 1 + x.
using Big = boost::multiprecision::cpp_bin_float_50;

Big expm1_big(const Big& x) { return abs(x) < Big(1e-20) ? x + x * x / 2 + x * x * x / 6 : Big(exp(x) - 1); }
Big tanh_big(const Big& x) { return abs(x) < Big(1e-20) ? x - x * x * x / 3 : Big(tanh(x)); }

// A head over logits z and bounds c, for finish: the meter statistics in the given form, and the
// softmax sums the report needs (no value error, unit values).
HeadState head_of(const MeterStats& meter, const std::vector<Token>& ts) {
  HeadState h;
  h.meter = meter;
  for (const Token& t : ts) h.m = std::max(h.m, t.z);
  for (const Token& t : ts) h.l += std::exp(t.z - h.m);
  h.v_max = 1.0;
  return h;
}

// One head in the scalar order through both paths: the kernel's state (for finish) and the CPU
// reference's report (attention::finish) over the same tokens.
struct BothPaths {
  HeadState gpu;
  attention::HeadResult cpu;
};
BothPaths both_paths(const std::vector<Token>& ts) {
  MeterStats scalar;
  attention::HeadPartial cpu;
  for (const Token& t : ts) {
    if (t.moment) {
      scalar.add_moment(t.z, t.c), cpu.meter.add_moment(t.z, t.c);
    } else {
      scalar.add(t.z, t.c), cpu.meter.add(t.z, t.c);
    }
  }
  BothPaths b{head_of(scalar, ts), {}};
  cpu.m = b.gpu.m, cpu.l = b.gpu.l, cpu.v_max = b.gpu.v_max;
  cpu.acc.assign(1, 0.0);
  float out[1];
  b.cpu = attention::finish(cpu, 1, out);
  return b;
}

// The kernel's meter at the edges of double against 50-digit arithmetic: every c_t subnormal
// (tanh(c_max/2) once underflowed there to a meter of 0, below the true worst case), c_t from 30 to
// 710, both in one head, logits far from 0, moment tokens. In the scalar order the report is
// attention::finish's bit for bit; in the scalar and the tile order each shape finish takes the minimum
// of is at least its exact value (and, away from overflow, within its margins above it), and the
// meter is never 0 while some c_t > 0.
TEST(CudaMeterStats, EdgesAgainstFiftyDigits) {
  const double tiny = std::numeric_limits<double>::denorm_min();
  struct Case {
    std::vector<double> z, c;
    bool moments = false;  // every other token a moment token
  };
  std::vector<Case> cases = {
      {{std::log(0.25), std::log(0.75)}, {tiny, tiny}},
      {{std::log(0.25), std::log(0.75)}, {tiny, 3 * tiny}},
      {{std::log(0.5), std::log(0.25), std::log(0.25)}, {tiny, 0.0, 5 * tiny}},
      {{std::log(0.25), std::log(0.75)}, {1e-310, 1e-320}},
      {{0.0, 0.0}, {30.0, 0.0}},
      {{0.0, 0.0}, {300.0, 0.0}},
      {{0.0, 0.0}, {700.0, 0.0}},
      {{0.0, 0.0}, {710.0, 0.0}},
      {{0.0, 0.0}, {700.0, 700.0}},
      {{0.0, -6.9}, {30.0, 300.0}},
      {{-0.2, 0.1, 0.9}, {tiny, 700.0, 0.3}},
      {{1000.0, 999.5, 998.0}, {700.0, tiny, 0.1}},
      {{-700.0, 0.0, 3.0}, {30.0, 300.0, tiny}},
  };
  // Forty tokens over two tiles, all c_t subnormal, half of them moment tokens; and the same with
  // every token a plain one.
  for (bool moments : {true, false}) {
    Case k{{}, {}, moments};
    for (int t = 0; t < 40; ++t) {
      k.z.push_back(0.1 * t - 2.0);
      k.c.push_back((t % 7 + 1) * tiny);
    }
    cases.push_back(k);
  }
  const char* names[] = {"eform", "two-sided", "tanh", "tanh-half"};
  for (const Case& k : cases) {
    SCOPED_TRACE("c = " + ::testing::PrintToString(k.c) + (k.moments ? " (moments)" : ""));
    const std::size_t n = k.z.size();
    std::vector<Token> ts(n);
    for (std::size_t t = 0; t < n; ++t) ts[t] = {k.z[t], k.c[t], k.moments && t % 2 == 1};
    // The exact shapes: a = A − 1 and am = 1 − A⁻ beside A⁻, so that A² − 1 and A/A⁻ − A⁻/A keep
    // their digits both when every c_t is subnormal and when A⁻ is e^-700.
    std::vector<Big> p(n);
    Big total = 0, a = 0, am = 0, Am = 0, c_max = 0;
    for (std::size_t t = 0; t < n; ++t) total += p[t] = exp(Big(k.z[t]) - Big(k.z[0]));
    for (std::size_t t = 0; t < n; ++t) {
      const Big c = k.c[t];
      p[t] /= total;
      a += p[t] * expm1_big(c);
      am -= p[t] * expm1_big(-c);
      Am += p[t] * exp(-c);
      c_max = std::max(c_max, c);
    }
    const std::array<Big, 4> want = {a * (a + 2) / 2, (a + am) * (1 + a + Am) / (2 * (1 + a) * Am), tanh_big(c_max),
                                     tanh_big(c_max / 2)};
    const Big want_meter = std::min(Big(1), *std::min_element(want.begin(), want.end()));

    const auto [gpu, cpu_report] = both_paths(ts);
    const HeadReport got = finish(gpu);
    EXPECT_TRUE(same_bits(got.meter, cpu_report.meter)) << got.meter << " vs " << cpu_report.meter;
    EXPECT_TRUE(same_bits(got.eform_raw, cpu_report.eform_raw)) << got.eform_raw << " vs " << cpu_report.eform_raw;

    for (const bool tiled : {false, true}) {
      SCOPED_TRACE(tiled ? "tile order" : "scalar order");
      const HeadState h = tiled ? head_of(tile_order(ts), ts) : gpu;
      const HeadReport r = finish(h);
      const std::array<double, 4> shapes = {eform_raw(r.log_A), two_sided_raw(r.log_A, r.log_A_minus),
                                            tanh_shape(h.meter.c_max), tanh_half_shape(h.meter.c_max)};
      EXPECT_TRUE(same_bits(shapes[0], r.eform_raw));
      for (int s = 0; s < 4; ++s) {
        SCOPED_TRACE(names[s]);
        EXPECT_GE(Big(shapes[s]), want[s]) << shapes[s] << " below " << want[s];
        // Near the top of the double range a shape may overflow early to +inf (no guarantee);
        // elsewhere it is within its margins: an absolute one in log A (about 1e-13 here) for
        // the log-domain shapes, one subnormal ulp for the tanh shapes.
        if (shapes[s] == kInf) {
          EXPECT_GT(want[s], Big(1e300));
        } else {
          EXPECT_LE(Big(shapes[s]), want[s] * Big(1 + 1e-9) + Big(s < 2 ? 1e-11 : 2 * tiny))
              << shapes[s] << " vs " << want[s];
        }
      }
      EXPECT_GT(r.meter, 0.0);
      EXPECT_LE(r.meter, 1.0);
      EXPECT_GE(Big(r.meter), want_meter) << r.meter << " below " << want_meter;
    }
  }
}

// A NaN or negative bound is no bound: the meter reads 1 (no guarantee), never the smaller value,
// as the cert layer's clamp_meter and Bounds::meter read it.
TEST(CudaMeterStats, NegativeOrNanReadsAsNoGuarantee) {
  const double tiny = std::numeric_limits<double>::denorm_min();
  for (double v : {-tiny, -1e-300, -0.5, -1.0, -kInf, static_cast<double>(NAN)}) {
    SCOPED_TRACE(v);
    EXPECT_EQ(clamp_meter(v), 1.0);
    EXPECT_EQ(cert::clamp_meter(v), 1.0);
    for (int slot = 0; slot < 5; ++slot) {
      double forms[] = {0.25, 0.5, 0.125, 0.75, 0.0625};
      forms[slot] = v;
      EXPECT_EQ(min_meter(forms, 5), 1.0) << slot;
      const cert::Bounds b{forms[0], forms[1], forms[2], forms[3], forms[4]};
      EXPECT_EQ(b.meter(), 1.0) << slot;
    }
  }
  const double ok[] = {0.25, 0.5, 0.125, 0.75, 0.0625};
  EXPECT_EQ(min_meter(ok, 5), 0.0625);
  EXPECT_EQ(clamp_meter(2.0), 1.0);
  EXPECT_EQ(clamp_meter(kInf), 1.0);

  // Through finish: a NaN bound or logit, and a negative c_t (outside the precondition c_t ≥ 0)
  // that leaves log A below 0 and so the e-form and two-sided shapes negative.
  struct Case {
    std::vector<double> z, c;
  };
  const std::vector<Case> cases = {
      {{0.0, 1.0}, {NAN, 0.1}},
      {{0.0, 1.0}, {0.1, NAN}},
      {{NAN, 1.0}, {0.1, 0.2}},
      {{std::log(0.1), std::log(0.9)}, {0.5, -1.0}},
      {{std::log(0.1), std::log(0.9)}, {0.5, -2.0}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE("z = " + ::testing::PrintToString(k.z) + ", c = " + ::testing::PrintToString(k.c));
    std::vector<Token> ts;
    for (std::size_t t = 0; t < k.z.size(); ++t) ts.push_back({k.z[t], k.c[t], false});
    const auto [gpu, want] = both_paths(ts);
    const HeadReport got = finish(gpu);
    EXPECT_EQ(got.meter, 1.0);
    EXPECT_TRUE(same_bits(got.meter, want.meter)) << got.meter << " vs " << want.meter;
    EXPECT_TRUE(same_bits(got.eform_raw, want.eform_raw)) << got.eform_raw << " vs " << want.eform_raw;
    EXPECT_EQ(finish(head_of(tile_order(ts), ts)).meter, 1.0);
  }
}
}  // namespace
}  // namespace witcert::cuda
