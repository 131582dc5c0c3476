#include "apps/serve/request_policy.h"

#include <cmath>

namespace witcert::apps {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

}  // namespace

void apply_policy(const nlohmann::json& j, const engine::CacheOptions& base, double coverage_tau,
                  double coverage_tau_v, engine::BatchRequest& r) {
  r.cache = base;
  r.coverage_tau = coverage_tau;
  r.coverage_tau_v = coverage_tau_v;
  const bool policy = j.contains("tau") || j.contains("tau_v") || j.contains("granularity") || j.contains("delta") ||
                      j.contains("bound") || j.contains("coverage_tau") || j.contains("coverage_tau_v");
  require(!policy || base.certified, "tau, tau_v, granularity, delta, bound and coverage figures need --kv");
  engine::read_json(j, "tau", r.cache.gate.tau_k);
  engine::read_json(j, "tau_v", r.cache.gate.tau_v);
  if (j.contains("granularity")) {
    std::string g;
    engine::read_json(j, "granularity", g);
    r.cache.gate.granularity = gate::parse_granularity(g);
  }
  engine::read_json(j, "delta", r.cache.delta);
  if (j.contains("bound")) {
    std::string b;
    engine::read_json(j, "bound", b);
    r.cache.bound = cert::parse_bound_shape(b);
  }
  engine::read_json(j, "coverage_tau", r.coverage_tau);
  engine::read_json(j, "coverage_tau_v", r.coverage_tau_v);
  require(r.coverage_tau > 0 && r.coverage_tau <= 1, "coverage_tau must be in (0, 1]");
  require(std::isfinite(r.coverage_tau_v) && r.coverage_tau_v > 0, "coverage_tau_v must be finite and > 0");
  r.cache.validate();
}

}  // namespace witcert::apps
