// Decode attention that produces its output and the meter in the same pass over K/V
// (paper §6.2; DESIGN §1). For every token of a range the kernel reads k̂_t, v̂_t and their
// bounds once and accumulates, per query head of the GQA group,
//   the softmax output (online, max-shifted),  LSE(z̃), LSE(z̃ + c), LSE(z̃ − c),  Σ p̃_t ρ^v_t,
// so that every bound shape of DESIGN §1 comes out of one pass. Partial results of disjoint
// token ranges (split-KV) merge under the same LSE weights as the output.
//
// This is the scalar reference: double accumulation, one token at a time.
#pragma once

#include <cstdint>
#include <vector>

#include "cert/meter.h"
#include "kvcache/kv_store.h"

namespace witcert::attention {

// The per-token logit-error bound c_t for one query: Tier A from the witness, Tier B from the
// dither scales (u_t), 0 for exact tokens.
struct BoundContext {
  double sm = 0.0;               // 1/sqrt(head_dim)
  std::int64_t S = 1;            // tokens the query attends over (the union bound's S)
  double delta_loc = 1e-2;       // Tier B failure budget of this cell
};

// One query head's partial result over a token range.
struct HeadPartial {
  double m = -INFINITY;          // running max of z̃
  double l = 0.0;                // Σ e^{z̃_t − m}
  std::vector<double> acc;       // Σ e^{z̃_t − m} v̂_t
  double rho = 0.0;              // Σ e^{z̃_t − m} ρ^v_t
  double rho2 = 0.0;             // Σ e^{2(z̃_t − m)} (ρ^v_t)², the value side's Tier-B variance term
  double v_max = 0.0;            // max_t (‖v̂_t‖ + ρ^v_t) ≥ max_t ‖v_t‖
  double float_rho_max = 0.0;    // max_t ρ^v_t over the tokens whose weight was computed in float
  cert::MeterStats meter;        // LSE(z̃), LSE(z̃ ± c), c_max

  void merge(const HeadPartial& o);
  // One token of the range in order: logit z, its value v̂ (head_dim floats), ρ^v and ‖v̂‖. A
  // non-finite z poisons the output (NaN) or only moves the max (±inf), as the meter reads it.
  void add(double z, const float* v, int head_dim, double rho, double v_norm);
};

// Accumulates tokens [begin, end) of one (layer, KV head) into one partial per query head of
// the group (q: group × head_dim).
void attend_range_reference(kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                            std::int64_t begin, std::int64_t end, const BoundContext& ctx,
                            std::vector<HeadPartial>& partials);

// What one query head's attention reports, from a merged partial.
struct HeadResult {
  double eform_raw = 0.0;   // Theorem 1, unclamped: the risk score
  double meter = 0.0;       // the chosen bound shape, clamped to 1
  double v_meter = 0.0;     // Σ p̃ ρ^v / max‖v‖, or its Tier-B form (finish's delta_v) where smaller
  double v_meter_sure = 0.0;  // Σ p̃ ρ^v / max‖v‖ always
  double output_bound = 0.0;  // ‖y − ŷ‖ ≤ 2·meter·max‖v‖ + Σ p̃ ρ^v
};

// Writes the output (head_dim floats) and returns the head's meters under `shape`. The one-pass
// partial holds every shape but the retention form, for which the meter is the e-form here and
// the caller replaces it with retention_raw's. delta_v > 0: the values carry their own dither
// (KvStore::value_dither) and the value side takes cert::value_tier_b at that budget.
HeadResult finish(const HeadPartial& p, int head_dim, float* out, cert::BoundShape shape = cert::BoundShape::min,
                  double delta_v = 0.0);

// Proposition 1's per-token retention form of each query head of the group over [begin, end):
// A and A⁻ from one reference pass, then a second pass over the tokens (unclamped).
std::vector<double> retention_raw(kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                                  std::int64_t begin, std::int64_t end, const BoundContext& ctx);

// Block repair planning (§6.3.5), per query head h of the group and logical page j of [begin, end)
// (indexed from page 0; pages before begin's have no terms):
//   a[h][j]   = Σ_{t∈j} p̃_t (e^{c_t} − 1), the page's term of A = Σ_t p̃_t e^{c_t};
//   rho[h][j] = Σ_{t∈j} p̃_t ρ^v_t, its term of the value side's Σ_t p̃_t ρ^v_t.
// Replacing page j by exact keys and values removes exactly these terms with p̃ held fixed.
// lse_z[h] is LSE(z̃) of head h over [begin, end).
struct PageTerms {
  std::vector<std::vector<double>> a, rho;
};
PageTerms page_contributions(kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                             std::int64_t begin, std::int64_t end, const BoundContext& ctx,
                             const std::vector<double>& lse_z);

// True TV(p, p̃) between attention over the exact tier and over the keys the runtime reads,
// for one query over [begin, end) (the soundness check; reads every key twice).
double true_tv(kvcache::KvStore::Reader& reader, const float* q, int head_dim, std::int64_t begin, std::int64_t end);
// The same TV and what the values the runtime reads add to the output's error, ‖Σ_t p̃_t (v̂_t − v_t)‖
// (the value side's soundness check: the V meter times max‖v‖ bounds it; reads keys and values twice).
struct TrueErrors {
  double tv = 0.0;
  double value_error = 0.0;
};
TrueErrors true_errors(kvcache::KvStore::Reader& reader, const float* q, int head_dim, std::int64_t begin,
                       std::int64_t end);

}  // namespace witcert::attention
