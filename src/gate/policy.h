// The gate's policy (paper §4.3, §5 "Joint K+V", §6.3.4–6.3.5): when any query head of a (layer,
// KV head) group fails pass_K ∧ pass_V — its K meter above τ_K or its V meter above τ_V — pages are
// repaired from the exact tier and the step's attention is recomputed. τ_K < 1 is certified gating
// on the clamped K meter; τ_K ≥ 1 is risk-ranked gating on the raw score.
#pragma once

#include <span>
#include <string_view>

#include "attention/reference/certified_attention.h"

namespace witcert::gate {

enum class Granularity {
  head,     // every page of the (layer, KV head)
  block,    // pages in decreasing order of their term of A, until the meter is under τ
  request,  // every page of every (layer, KV head) of the request
};

// "head", "block", "request"; parse_granularity throws std::invalid_argument on anything else.
const char* granularity_name(Granularity g);
Granularity parse_granularity(std::string_view name);

struct Policy {
  double tau_k = 0.0;   // 0: no gate
  Granularity granularity = Granularity::block;
  double tau_v = 0.05;

  bool operator==(const Policy&) const = default;
  bool on() const { return tau_k != 0.0; }
  bool certified() const { return tau_k < 1.0; }
  // Throws std::invalid_argument unless τ_K is 0 or finite and positive, and τ_V (when on) too.
  void validate() const;
  bool pass_k(const attention::HeadResult& r) const { return certified() ? r.meter <= tau_k : r.eform_raw <= tau_k; }
  bool pass_v(const attention::HeadResult& r) const { return r.v_meter <= tau_v; }
  // Any-of-G over the query heads of one KV head: some head fails pass_K ∧ pass_V.
  bool triggered(std::span<const attention::HeadResult> heads) const;
};

}  // namespace witcert::gate
