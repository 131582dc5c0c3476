#include "gate/policy.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace witcert::gate {

const char* granularity_name(Granularity g) {
  switch (g) {
    case Granularity::head: return "head";
    case Granularity::block: return "block";
    case Granularity::request: return "request";
  }
  return "?";
}

Granularity parse_granularity(std::string_view name) {
  for (Granularity g : {Granularity::head, Granularity::block, Granularity::request})
    if (name == granularity_name(g)) return g;
  throw std::invalid_argument("granularity must be head, block or request, got '" + std::string(name) + "'");
}

GateMode Policy::mode_of(double tau_k) {
  if (tau_k == 0.0) return NoGate{};
  if (tau_k < 1.0) return CertifiedGate{tau_k};
  return RiskRankedGate{tau_k};  // NaN too, which validate() refuses
}

double Policy::tau_k() const {
  if (const auto* c = std::get_if<CertifiedGate>(&mode)) return c->tau_k;
  if (const auto* k = std::get_if<RiskRankedGate>(&mode)) return k->raw_threshold;
  return 0.0;
}

void Policy::validate() const {
  const double t = tau_k();
  if (!(t >= 0.0) || std::isinf(t)) throw std::invalid_argument("tau_k must be finite and positive (0: no gate)");
  // Checked with the gate off too: a τ_V out of range is a mistake even where nothing reads it yet.
  if (!(tau_v > 0.0 && std::isfinite(tau_v)))
    throw std::invalid_argument("tau_v must be finite and positive");
}

bool Policy::triggered(std::span<const attention::HeadResult> heads) const {
  if (!on()) return false;
  for (const attention::HeadResult& r : heads)
    if (!pass_k(r) || !pass_v(r)) return true;
  return false;
}

}  // namespace witcert::gate
