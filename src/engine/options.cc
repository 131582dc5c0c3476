#include "engine/options.h"

#include <cmath>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace witcert::engine {
namespace {

constexpr int kMaxTokens = 1'000'000;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// An object whose keys all belong to `known`.
void check_keys(const nlohmann::json& j, std::initializer_list<std::string_view> known, const char* what) {
  require(j.is_object(), std::string(what) + " must be a JSON object");
  for (const auto& [key, value] : j.items()) {
    bool ok = false;
    for (std::string_view k : known) ok = ok || key == k;
    if (!ok) {
      std::string list;
      for (std::string_view k : known) list += (list.empty() ? "" : ", ") + std::string(k);
      throw std::invalid_argument(std::string(what) + ": unknown key '" + key + "' (known: " + list + ")");
    }
  }
}

// j[key] as T when present; a wrong type names the key.
template <class T>
void read(const nlohmann::json& j, const char* key, T& out) {
  const auto it = j.find(key);
  if (it == j.end()) return;
  if constexpr (std::is_same_v<T, bool>) {
    require(it->is_boolean(), std::string(key) + " must be true or false");
  } else if constexpr (std::is_same_v<T, std::string>) {
    require(it->is_string(), std::string(key) + " must be a string");
  } else if constexpr (std::is_integral_v<T>) {
    const std::string range = std::string(key) + " must be a whole number in [" +
                              std::to_string(std::numeric_limits<T>::min()) + ", " +
                              std::to_string(std::numeric_limits<T>::max()) + "]";
    require(it->is_number_integer(), range);
    if (it->is_number_unsigned()) {
      require(it->get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<T>::max()), range);
    } else {
      const std::int64_t v = it->get<std::int64_t>();
      require(v >= 0 || std::is_signed_v<T>, range);
      if constexpr (std::is_signed_v<T>)
        require(v >= std::numeric_limits<T>::min() && v <= std::numeric_limits<T>::max(), range);
    }
  } else {
    require(it->is_number(), std::string(key) + " must be a number");
  }
  out = it->get<T>();
}

bool finite_positive(double v) { return std::isfinite(v) && v > 0; }

}  // namespace

void CacheOptions::validate() const {
  if (!certified) return;
  require(page_size >= 1 && page_size <= 4096, "page_size must be in [1, 4096], got " + std::to_string(page_size));
  require(outliers >= 0 && outliers <= 31, "outliers must be in [0, 31], got " + std::to_string(outliers));
  require(delta > 0 && delta < 1, "delta must be in (0, 1), got " + std::to_string(delta));
  gate.validate();
  require(backing.path.empty() || gate.on() || check_soundness,
          "--backing-file: nothing reads the exact tier without --gate or --check-soundness");
}

CacheOptions CacheOptions::from_json(const nlohmann::json& j) {
  check_keys(j,
             {"kv", "kv_v", "page_size", "outliers", "dither", "dither_seed", "delta", "bound", "gate", "tau_v",
              "granularity", "check_soundness", "exact_tier"},
             "cache");
  CacheOptions o;
  std::string kv, kv_v, dither, bound, granularity, exact_tier;
  read(j, "kv", kv);
  read(j, "kv_v", kv_v);
  o.certified = !kv.empty();
  if (!o.certified)
    for (const auto& [key, value] : j.items())
      require(key == "kv", key + " needs kv: without it the engine keeps a plain exact cache");
  if (o.certified) {
    o.k_format = quant::KvFormat::parse(kv);
    o.v_format = quant::KvFormat::parse(kv_v.empty() ? kv : kv_v);
  }
  read(j, "page_size", o.page_size);
  read(j, "outliers", o.outliers);
  if (read(j, "dither", dither), !dither.empty()) o.dither = cache::parse_dither_mode(dither);
  read(j, "dither_seed", o.dither_seed);
  read(j, "delta", o.delta);
  if (read(j, "bound", bound), !bound.empty()) o.bound = cert::parse_bound_shape(bound);
  read(j, "gate", o.gate.tau_k);
  read(j, "tau_v", o.gate.tau_v);
  if (read(j, "granularity", granularity), !granularity.empty()) o.gate.granularity = gate::parse_granularity(granularity);
  read(j, "check_soundness", o.check_soundness);
  read(j, "exact_tier", exact_tier);
  require(exact_tier.empty() || exact_tier == "ram" || exact_tier == "file",
          "exact_tier must be ram or file, got '" + exact_tier + "'");
  o.backing.ram = exact_tier == "ram";
  o.validate();
  return o;
}

void RequestOptions::validate() const {
  require(!prompt.empty(), "the prompt is empty");
  require(max_new_tokens >= 0 && max_new_tokens <= kMaxTokens,
          "max_tokens must be in [0, " + std::to_string(kMaxTokens) + "], got " + std::to_string(max_new_tokens));
  require(std::isfinite(sampler.temperature) && sampler.temperature >= 0,
          "temperature must be finite and >= 0, got " + std::to_string(sampler.temperature));
  require(sampler.top_p > 0 && sampler.top_p <= 1, "top_p must be in (0, 1], got " + std::to_string(sampler.top_p));
  require(coverage_tau > 0 && coverage_tau <= 1, "coverage_tau must be in (0, 1], got " + std::to_string(coverage_tau));
  require(finite_positive(coverage_tau_v), "coverage_tau_v must be finite and > 0, got " + std::to_string(coverage_tau_v));
  require(stride >= 1, "stride must be at least 1, got " + std::to_string(stride));
}

RequestOptions RequestOptions::from_json(const nlohmann::json& j) {
  check_keys(j, {"prompt", "chat", "max_tokens", "temperature", "top_p", "seed", "coverage_tau", "coverage_tau_v", "stride"},
             "request");
  require(j.contains("prompt"), "request: prompt is required");
  RequestOptions o;
  read(j, "prompt", o.prompt);
  read(j, "chat", o.chat);
  read(j, "max_tokens", o.max_new_tokens);
  read(j, "temperature", o.sampler.temperature);
  read(j, "top_p", o.sampler.top_p);
  read(j, "seed", o.sampler.seed);
  read(j, "coverage_tau", o.coverage_tau);
  read(j, "coverage_tau_v", o.coverage_tau_v);
  read(j, "stride", o.stride);
  o.validate();
  return o;
}

void EngineOptions::validate() const {
  require(threads >= 1 && threads <= 256, "threads must be in [1, 256], got " + std::to_string(threads));
  cache.validate();
}

EngineOptions EngineOptions::from_json(const nlohmann::json& j) {
  check_keys(j, {"model", "threads", "cache"}, "engine");
  EngineOptions o;
  read(j, "model", o.model);
  read(j, "threads", o.threads);
  if (j.contains("cache")) o.cache = CacheOptions::from_json(j["cache"]);
  o.validate();
  return o;
}

}  // namespace witcert::engine
