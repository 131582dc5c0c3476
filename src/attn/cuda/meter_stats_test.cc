// The meter's statistics of the CUDA kernel (meter_stats.h), run on the host: bit for bit the cert
// layer's in the scalar order, and sound in the kernel's merge order.
#include "attn/cuda/meter_stats.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "attn/certified_attention.h"
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
    // The same tokens split into ranges, each merged in order: attn's split-KV.
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
    attn::HeadPartial cpu;
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
    const attn::HeadResult want = attn::finish(cpu, 4, out);
    const HeadReport got = finish(gpu);
    EXPECT_TRUE(same_bits(got.eform_raw, want.eform_raw)) << trial;
    EXPECT_TRUE(same_bits(got.meter, want.meter)) << trial << ": " << got.meter << " vs " << want.meter;
    EXPECT_TRUE(same_bits(got.v_meter, want.v_meter)) << trial;
    EXPECT_TRUE(same_bits(got.output_bound, want.output_bound)) << trial;
  }
}

}  // namespace
}  // namespace witcert::cuda
