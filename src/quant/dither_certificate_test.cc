// Monte Carlo check of the Tier-B certificate at the request level (paper §4.2): over many
// independent dither seeds, a request counts as violated if any token of any (layer, head,
// step) cell has |ε_t| > u_t. The violation rate must not exceed δ_req. Queries are fixed in
// advance (non-adaptive), which is the scope of the guarantee.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cert/subgaussian.h"
#include "cert/witness.h"
#include "quant/dither_int8.h"

namespace witcert::quant {
namespace {

struct Workload {
  int layers, q_heads, kv_heads, steps, S, d, outlier_pairs;
  double delta_req;
};

struct Outcome {
  long requests = 0, violated_requests = 0, cells = 0;
  double worst_ratio = 0.0;  // max over every token of every cell of |ε_t| / u_t
};

// One (layer, KV head): its fixed keys and outlier channels.
struct KeySet {
  std::vector<float> keys;          // S × d, fp16 values
  std::vector<std::uint8_t> mask;   // d
  int n_outliers = 0;
};

KeySet draw_keys(const Workload& st, std::mt19937_64& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  KeySet ks;
  ks.keys.resize(st.S * st.d);
  ks.mask.assign(st.d, 0);
  std::vector<float> gain(st.d);  // heavy-tailed channel energies, as in real models
  for (float& g : gain) g = std::exp(1.5f * n(rng));
  for (int t = 0; t < st.S; ++t)
    for (int c = 0; c < st.d; ++c)
      ks.keys[t * st.d + c] = static_cast<float>(fp16_to_double(fp16_from_double(gain[c] * n(rng))));
  // Outlier pairs: the highest-energy RoPE pairs of this (layer, kv head).
  std::vector<double> energy(st.d / 2, 0.0);
  for (int t = 0; t < st.S; ++t)
    for (int j = 0; j < st.d / 2; ++j) {
      const cert::RopePair p = cert::rope_pair(cert::RopeLayout::neox, st.d, j);
      const double a = ks.keys[t * st.d + p.lo], b = ks.keys[t * st.d + p.hi];
      energy[j] += a * a + b * b;
    }
  for (int m = 0; m < st.outlier_pairs; ++m) {
    const int j = static_cast<int>(std::max_element(energy.begin(), energy.end()) - energy.begin());
    energy[j] = -1.0;
    const cert::RopePair p = cert::rope_pair(cert::RopeLayout::neox, st.d, j);
    ks.mask[p.lo] = ks.mask[p.hi] = 1;
  }
  ks.n_outliers = 2 * st.outlier_pairs;
  return ks;
}

// radius_factor scales u_t: 1 is the certificate; < 1 is a deliberately unsound radius, the
// negative control showing that this count can fail.
Outcome run(const Workload& st, long requests, double radius_factor, std::uint64_t data_seed) {
  const int G = std::min(32, st.d);
  const double sm = 1.0 / std::sqrt(double(st.d));
  std::mt19937_64 rng(data_seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<KeySet> sets;
  for (int s = 0; s < st.layers * st.kv_heads; ++s) sets.push_back(draw_keys(st, rng));
  std::vector<std::vector<float>> queries(st.layers * st.q_heads * st.steps, std::vector<float>(st.d));
  for (auto& q : queries)
    for (float& v : q) v = 2.0f * n(rng);

  const double dl = cert::delta_loc(st.delta_req, st.layers, st.q_heads, st.steps);
  Outcome out;
  std::vector<float> xi(st.d), decoded(st.d);
  std::vector<std::int8_t> codes(st.d);
  std::vector<f16> scales(st.S * st.d / G);
  std::vector<double> residual(st.S * st.d);
  for (long r = 0; r < requests; ++r) {
    bool request_violated = false;
    for (int s = 0; s < st.layers * st.kv_heads; ++s) {
      const int layer = s / st.kv_heads, kv = s % st.kv_heads;
      const KeySet& ks = sets[s];
      const DitherStream stream{0x5eed0000ull + static_cast<std::uint64_t>(r), static_cast<std::uint32_t>(layer),
                                static_cast<std::uint32_t>(kv)};
      std::vector<f16> outliers(ks.n_outliers);
      for (int t = 0; t < st.S; ++t) {
        dither_values(stream, static_cast<std::uint32_t>(t), xi);
        const std::span<const float> x(&ks.keys[t * st.d], st.d);
        const std::span<f16> token_scales(&scales[t * st.d / G], st.d / G);
        encode_dither_int8(x, xi, ks.mask, G, codes, token_scales, outliers);
        decode_dither_int8(codes, token_scales, xi, ks.mask, outliers, G, decoded);
        for (int c = 0; c < st.d; ++c) residual[t * st.d + c] = double(decoded[c]) - double(x[c]);
      }
      for (int h = 0; h < st.q_heads; ++h) {
        if (h * st.kv_heads / st.q_heads != kv) continue;  // GQA: query head h reads kv head kv
        for (int step = 0; step < st.steps; ++step) {
          const std::vector<float>& q = queries[(layer * st.q_heads + h) * st.steps + step];
          for (int t = 0; t < st.S; ++t) {
            const double v2 = cert::dither_variance_proxy(
                q, std::span<const f16>(&scales[t * st.d / G], st.d / G), ks.mask, G, sm);
            const double u = radius_factor * cert::subgaussian_radius(v2, st.S, dl, st.d - ks.n_outliers);
            double eps = 0.0;
            for (int c = 0; c < st.d; ++c) eps += double(q[c]) * residual[t * st.d + c];
            eps *= sm;
            out.worst_ratio = std::max(out.worst_ratio, std::fabs(eps) / u);
            request_violated = request_violated || std::fabs(eps) > u;
          }
          ++out.cells;
        }
      }
    }
    ++out.requests;
    out.violated_requests += request_violated;
  }
  return out;
}

// The largest violation count that is still consistent with a rate ≤ δ at one-sided level
// 1e-6 (normal approximation with a continuity margin): above it, the rate exceeds δ.
long max_consistent(long n, double delta) {
  const double mean = n * delta, sd = std::sqrt(n * delta * (1.0 - delta));
  return static_cast<long>(std::ceil(mean + 4.9 * sd + 1.0));
}

TEST(DitherCertificate, RequestLevelViolationRateAtDeltaOnePercent) {
  // 2 layers × 3 query heads (GQA 3:1) × 8 steps × 64 tokens, d = 64, m = 2 outlier pairs.
  const Workload st{2, 3, 1, 8, 64, 64, 2, 1e-2};
  const long R = 3000;
  const Outcome o = run(st, R, 1.0, 2024);
  std::printf("[tier-b] delta_req=%.3g: %ld / %ld requests violated (%ld cells each), worst |eps|/u = %.4f\n",
              st.delta_req, o.violated_requests, o.requests, o.cells / o.requests, o.worst_ratio);
  EXPECT_LE(o.violated_requests, max_consistent(R, st.delta_req));
}

TEST(DitherCertificate, LooseDeltaStaysWithinBudgetAndUnsoundRadiusIsCaught) {
  // δ_req = 0.5 on one cell of one token: the radius is small enough for violations to
  // occur at all, so the count is informative in both directions.
  const Workload st{1, 1, 1, 1, 1, 64, 0, 0.5};
  const long R = 20000;
  const Outcome ok = run(st, R, 1.0, 7);
  const Outcome bad = run(st, R, 0.3, 7);
  std::printf("[tier-b] delta_req=0.5, one token: %ld / %ld violated with u_t; %ld / %ld with 0.3*u_t\n",
              ok.violated_requests, R, bad.violated_requests, R);
  EXPECT_GT(ok.violated_requests, 0) << "the check must be able to see violations";
  EXPECT_LE(ok.violated_requests, max_consistent(R, st.delta_req));
  EXPECT_GT(bad.violated_requests, max_consistent(R, st.delta_req))
      << "a radius 0.3× too small must be detected as exceeding δ";
}

}  // namespace
}  // namespace witcert::quant
