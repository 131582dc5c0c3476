// The gate's policy (paper §4.3, §5 "Joint K+V", §6.3.4–6.3.5): when any query head of a (layer,
// KV head) group fails pass_K ∧ pass_V — its K meter above τ_K or its V meter above τ_V — pages are
// repaired from the exact tier and the step's attention is recomputed.
#pragma once

#include <span>
#include <string_view>
#include <variant>

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

// The gate's decision rule (a variant, so that no value of a number stands for a mode): none;
// certified, on the clamped K meter against τ_K ∈ (0, 1), which holds every served cell's TV to
// τ_K; or risk-ranked, on the raw e-form score against a threshold ≥ 1, which ranks cells by
// their risk and certifies nothing.
struct NoGate {
  bool operator==(const NoGate&) const = default;
};
struct CertifiedGate {
  double tau_k = 0.2;
  bool operator==(const CertifiedGate&) const = default;
};
struct RiskRankedGate {
  double raw_threshold = 1.0;
  bool operator==(const RiskRankedGate&) const = default;
};
using GateMode = std::variant<NoGate, CertifiedGate, RiskRankedGate>;

struct Policy {
  GateMode mode;
  Granularity granularity = Granularity::block;
  double tau_v = 0.05;

  // The mode from the options' one number for it (tau_k in JSON, the C API and Python; --gate on
  // the command line): 0 no gate, below 1 certified at τ_K, from 1 up risk-ranked at that raw
  // score. validate() refuses a negative or non-finite number.
  static GateMode mode_of(double tau_k);
  static Policy from_tau_k(double tau_k, Granularity granularity = Granularity::block, double tau_v = 0.05) {
    return {mode_of(tau_k), granularity, tau_v};
  }
  void set_tau_k(double tau_k) { mode = mode_of(tau_k); }
  // That number back: 0, τ_K or the raw-score threshold.
  double tau_k() const;

  bool operator==(const Policy&) const = default;
  bool on() const { return !std::holds_alternative<NoGate>(mode); }
  bool certified() const { return std::holds_alternative<CertifiedGate>(mode); }
  // Throws std::invalid_argument unless τ_K is 0 or finite and positive, and τ_V too.
  void validate() const;
  bool pass_k(const attention::HeadResult& r) const {
    if (const auto* c = std::get_if<CertifiedGate>(&mode)) return r.meter <= c->tau_k;
    if (const auto* k = std::get_if<RiskRankedGate>(&mode)) return r.eform_raw <= k->raw_threshold;
    return true;
  }
  bool pass_v(const attention::HeadResult& r) const { return r.v_meter <= tau_v; }
  // Any-of-G over the query heads of one KV head: some head fails pass_K ∧ pass_V.
  bool triggered(std::span<const attention::HeadResult> heads) const;
};

}  // namespace witcert::gate
