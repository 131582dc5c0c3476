// A request's meter policy from its JSON object, shared by `witcert batch` and `witcert serve`.
#pragma once

#include <nlohmann/json.hpp>

#include "engine/batch.h"
#include "engine/options.h"

namespace witcert::apps {

// A request's meter policy from its JSON object (keys tau, tau_v, granularity, delta, bound,
// coverage_tau, coverage_tau_v, each optional) over the pool's options `base`: sets r.cache and
// r's coverage figures. Throws std::invalid_argument naming the key (policy keys without a
// certified cache, wrong types, values out of range).
void apply_policy(const nlohmann::json& j, const engine::CacheOptions& base, double coverage_tau,
                  double coverage_tau_v, engine::BatchRequest& r);

}  // namespace witcert::apps
