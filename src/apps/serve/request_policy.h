// A request's fields from its JSON object, shared by `witcert batch` and `witcert serve`: typed
// reads that name the key, and the request's meter policy over the pool's options.
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "engine/batch.h"
#include "engine/options.h"

namespace witcert::apps {

// j[key] as T into out, left as it is when absent. Throws std::invalid_argument naming the key
// when the value has the wrong type.
template <class T>
void read_field(const nlohmann::json& j, const char* key, T& out) {
  if (!j.contains(key)) return;
  try {
    out = j.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    throw std::invalid_argument(std::string(key) + " has the wrong type");
  }
}

// A request's meter policy from its JSON object (keys tau, tau_v, granularity, delta, bound,
// coverage_tau, coverage_tau_v, each optional) over the pool's options `base`: sets r.cache and
// r's coverage figures. Throws std::invalid_argument naming the key (policy keys without a
// certified cache, wrong types, values out of range).
void apply_policy(const nlohmann::json& j, const engine::CacheOptions& base, double coverage_tau,
                  double coverage_tau_v, engine::BatchRequest& r);

}  // namespace witcert::apps
