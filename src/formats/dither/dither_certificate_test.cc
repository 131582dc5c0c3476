// Monte Carlo check of the Tier-B certificate at the request level (paper §4.2): over many
// independent dither seeds, a request counts as violated if any token of any (layer, head,
// step) cell has |ε_t| > u_t. The violation rate must not exceed δ_req. Queries are fixed in
// advance (non-adaptive), which is the scope of the guarantee. Every count runs twice: with
// the paper's dither per slot, and with one ξ per page of 16 tokens shared by its tokens
// (kvcache::DitherMode::shared_page, docs/dither-cost.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cert/subgaussian.h"
#include "cert/witness.h"
#include "formats/dither/dither.h"

namespace witcert::formats {
namespace {

// How a token's ξ is named: by its slot, or by its page (the counter word of
// kvcache/kv_store.cc: the page index with the top bit set, disjoint from slots).
enum class Dither { per_slot, shared_page };
constexpr int kPageSize = 16;

std::uint32_t dither_counter(Dither mode, int t) {
  return mode == Dither::shared_page ? static_cast<std::uint32_t>(t / kPageSize) | 0x80000000u
                                     : static_cast<std::uint32_t>(t);
}

const char* name(Dither mode) { return mode == Dither::shared_page ? "shared-page" : "per-slot"; }

DitherStream request_stream(long request, int layer, int kv_head) {
  return {0x5eed0000ull + static_cast<std::uint64_t>(request), static_cast<std::uint32_t>(layer),
          static_cast<std::uint32_t>(kv_head)};
}

struct Workload {
  int layers, q_heads, kv_heads, steps, S, d, outlier_pairs;
  double delta_req;
  int bits = 8;  // B of the dithered codes
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
Outcome run(const Workload& st, long requests, double radius_factor, std::uint64_t data_seed, Dither mode) {
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
  std::vector<float> xi(st.d), decoded(st.d);
  std::vector<std::int8_t> codes(st.d);
  // u_t depends on the query and the token's scales, and a scale on its group's amax alone,
  // never on ξ: one table of radii, [cell][token], serves every request.
  std::vector<std::vector<double>> u;
  for (int s = 0; s < st.layers * st.kv_heads; ++s) {
    const KeySet& ks = sets[s];
    std::vector<f16> scales(st.S * st.d / G), outliers(ks.n_outliers);
    for (int t = 0; t < st.S; ++t)
      encode_dither(st.bits, std::span<const float>(&ks.keys[t * st.d], st.d), xi, ks.mask, G, codes,
                         std::span<f16>(&scales[t * st.d / G], st.d / G), outliers);
    for (int h = 0; h < st.q_heads; ++h) {
      if (h * st.kv_heads / st.q_heads != s % st.kv_heads) continue;  // GQA: query head h reads kv head s % kv_heads
      for (int step = 0; step < st.steps; ++step) {
        const std::vector<float>& q = queries[((s / st.kv_heads) * st.q_heads + h) * st.steps + step];
        std::vector<double>& row = u.emplace_back(st.S);
        for (int t = 0; t < st.S; ++t) {
          const double v2 = cert::dither_variance_proxy(q, std::span<const f16>(&scales[t * st.d / G], st.d / G),
                                                        ks.mask, G, sm);
          row[t] = radius_factor * cert::subgaussian_radius(v2, st.S, dl, st.d - ks.n_outliers);
        }
      }
    }
  }

  Outcome out;
  std::vector<f16> token_scales(st.d / G);
  std::vector<double> residual(st.S * st.d);
  for (long r = 0; r < requests; ++r) {
    bool request_violated = false;
    std::size_t cell = 0;
    for (int s = 0; s < st.layers * st.kv_heads; ++s) {
      const int layer = s / st.kv_heads, kv = s % st.kv_heads;
      const KeySet& ks = sets[s];
      const DitherStream stream = request_stream(r, layer, kv);
      std::vector<f16> outliers(ks.n_outliers);
      for (int t = 0; t < st.S; ++t) {
        dither_values(stream, dither_counter(mode, t), xi);
        const std::span<const float> x(&ks.keys[t * st.d], st.d);
        encode_dither(st.bits, x, xi, ks.mask, G, codes, token_scales, outliers);
        decode_dither(codes, token_scales, xi, ks.mask, outliers, G, decoded);
        for (int c = 0; c < st.d; ++c) residual[t * st.d + c] = double(decoded[c]) - double(x[c]);
      }
      for (int h = 0; h < st.q_heads; ++h) {
        if (h * st.kv_heads / st.q_heads != kv) continue;
        for (int step = 0; step < st.steps; ++step, ++cell) {
          const std::vector<float>& q = queries[(layer * st.q_heads + h) * st.steps + step];
          for (int t = 0; t < st.S; ++t) {
            double eps = 0.0;
            for (int c = 0; c < st.d; ++c) eps += double(q[c]) * residual[t * st.d + c];
            eps *= sm;
            out.worst_ratio = std::max(out.worst_ratio, std::fabs(eps) / u[cell][t]);
            request_violated = request_violated || std::fabs(eps) > u[cell][t];
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
  // 2 layers × 3 query heads (GQA 3:1) × 8 steps × 64 tokens (4 pages), d = 64, m = 2 outlier pairs.
  const Workload st{2, 3, 1, 8, 64, 64, 2, 1e-2};
  const long R = 3000;
  for (Dither mode : {Dither::per_slot, Dither::shared_page}) {
    const Outcome o = run(st, R, 1.0, 2024, mode);
    std::printf("[tier-b] %-11s delta_req=%.3g: %ld / %ld requests violated (%ld cells each), worst |eps|/u = %.4f\n",
                name(mode), st.delta_req, o.violated_requests, o.requests, o.cells / o.requests, o.worst_ratio);
    EXPECT_LE(o.violated_requests, max_consistent(R, st.delta_req)) << name(mode);
  }
}

// Every width below 8 bits: the same certificate with its coarser step, at the request level and
// (δ_req = 0.5, one page) where violations occur at all, with the unsound radius caught.
TEST(DitherCertificate, EveryWidthBelow8BitsKeepsItsBudget) {
  for (int bits : {4, 5, 6}) {
    Workload st{2, 3, 1, 8, 64, 64, 2, 1e-2};
    st.bits = bits;
    const long R = 1000;
    for (Dither mode : {Dither::per_slot, Dither::shared_page}) {
      const Outcome o = run(st, R, 1.0, 2024 + bits, mode);
      std::printf("[tier-b] int%d %-11s delta_req=%.3g: %ld / %ld requests violated, worst |eps|/u = %.4f\n", bits,
                  name(mode), st.delta_req, o.violated_requests, o.requests, o.worst_ratio);
      EXPECT_LE(o.violated_requests, max_consistent(R, st.delta_req)) << bits << " bits " << name(mode);
    }
    Workload loose{1, 1, 1, 1, kPageSize, 64, 0, 0.5};
    loose.bits = bits;
    const Outcome ok = run(loose, 3000, 1.0, 7 + bits, Dither::per_slot);
    const Outcome bad = run(loose, 3000, 0.3, 7 + bits, Dither::per_slot);
    EXPECT_GT(ok.violated_requests, 0) << bits << " bits: the check must be able to see violations";
    EXPECT_LE(ok.violated_requests, max_consistent(3000, 0.5)) << bits << " bits";
    EXPECT_GT(bad.violated_requests, max_consistent(3000, 0.5)) << bits << " bits: 0.3·u_t must be caught";
  }
}

TEST(DitherCertificate, LooseDeltaStaysWithinBudgetAndUnsoundRadiusIsCaught) {
  // δ_req = 0.5 on one cell: the radius is small enough for violations to occur at all, so the
  // count is informative in both directions. One token, then one page of 16 tokens, where the
  // shared ξ makes the tokens' residuals dependent.
  for (const int S : {1, kPageSize}) {
    const Workload st{1, 1, 1, 1, S, 64, 0, 0.5};
    const long R = S == 1 ? 20000 : 5000;
    for (Dither mode : {Dither::per_slot, Dither::shared_page}) {
      if (S == 1 && mode == Dither::shared_page) continue;  // one token: nothing to share
      const Outcome ok = run(st, R, 1.0, 7, mode);
      const Outcome bad = run(st, R, 0.3, 7, mode);
      std::printf("[tier-b] %-11s delta_req=0.5, %2d token(s): %ld / %ld violated with u_t; %ld / %ld with 0.3*u_t\n",
                  name(mode), S, ok.violated_requests, R, bad.violated_requests, R);
      EXPECT_GT(ok.violated_requests, 0) << "the check must be able to see violations";
      EXPECT_LE(ok.violated_requests, max_consistent(R, st.delta_req)) << name(mode);
      EXPECT_GT(bad.violated_requests, max_consistent(R, st.delta_req))
          << name(mode) << ": a radius 0.3× too small must be detected as exceeding δ";
    }
  }
}

// The caveat of docs/dither-cost.md at its extreme: the last token of a page gets a key chosen
// from the dither of the token before it, as a generated token's key depends on the page's ξ
// through the attention outputs that chose it. The adversary here aims for the worst residual
// under a known query: with s = 1/8 (one channel at 126.5·s), y_c = x_c/s = ∓(½ − η) − ξ'_c puts
// y_c + ξ_c just inside a rounding boundary when ξ = ξ', so each residual is ≈ sign(q_c)·s/2 and
// ε ≈ sm·(s/2)·‖q‖₁, far beyond u_t. With a shared ξ the adversary's ξ' is the ξ its key is
// quantized with; per slot it is the previous slot's, independent of the new slot's.
Outcome run_adaptive_key(Dither mode, long requests) {
  constexpr int d = 64, S = kPageSize, G = 32;
  constexpr double s = 0.125, eta = 1.0 / 64, delta_req = 1e-2;
  const double sm = 1.0 / std::sqrt(double(d));
  std::mt19937_64 rng(99);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> q(d), keys(S * d);
  for (float& v : q) v = 2.0f * n(rng);
  for (int t = 0; t + 1 < S; ++t)
    for (int c = 0; c < d; ++c) keys[t * d + c] = static_cast<float>(fp16_to_double(fp16_from_double(n(rng))));
  const std::vector<std::uint8_t> no_outliers(d, 0);
  const double dl = cert::delta_loc(delta_req, 1, 1, 1);

  Outcome out;
  std::vector<float> xi(d), seen(d), decoded(d);
  std::vector<std::int8_t> codes(d);
  std::vector<f16> scales(d / G);
  for (long r = 0; r < requests; ++r) {
    const DitherStream stream = request_stream(r, 0, 0);
    dither_values(stream, dither_counter(mode, S - 2), seen);  // what the earlier token's ξ reveals
    float* adaptive = &keys[(S - 1) * d];
    for (int c = 0; c < d; ++c) {
      const double y = c % G == 0 ? 126.5 : (q[c] > 0 ? -(0.5 - eta) : 0.5 - eta) - seen[c];
      adaptive[c] = static_cast<float>(fp16_to_double(fp16_from_double(s * y)));
    }
    bool violated = false;
    for (int t = 0; t < S; ++t) {
      dither_values(stream, dither_counter(mode, t), xi);
      const std::span<const float> x(&keys[t * d], d);
      encode_dither(8, x, xi, no_outliers, G, codes, scales, {});
      decode_dither(codes, scales, xi, no_outliers, {}, G, decoded);
      double eps = 0.0;
      for (int c = 0; c < d; ++c) eps += double(q[c]) * (double(decoded[c]) - double(x[c]));
      eps *= sm;
      const double u = cert::subgaussian_radius(cert::dither_variance_proxy(q, scales, no_outliers, G, sm), S, dl, d);
      out.worst_ratio = std::max(out.worst_ratio, std::fabs(eps) / u);
      violated = violated || std::fabs(eps) > u;
    }
    ++out.requests;
    ++out.cells;
    out.violated_requests += violated;
  }
  return out;
}

TEST(DitherCertificate, AKeyThatDependsOnASharedDitherBreaksTheCertificate) {
  const long R = 2000;
  const Outcome slot = run_adaptive_key(Dither::per_slot, R);
  const Outcome page = run_adaptive_key(Dither::shared_page, R);
  std::printf("[tier-b] adaptive key, delta_req=0.01: per-slot %ld / %ld violated (worst |eps|/u %.3f); "
              "shared-page %ld / %ld (worst %.3f)\n",
              slot.violated_requests, R, slot.worst_ratio, page.violated_requests, R, page.worst_ratio);
  EXPECT_LE(slot.violated_requests, max_consistent(R, 1e-2)) << "per slot, the new key's ξ is fresh";
  EXPECT_EQ(page.violated_requests, R) << "a key aimed at its own shared ξ must violate every time";
}

}  // namespace
}  // namespace witcert::formats
