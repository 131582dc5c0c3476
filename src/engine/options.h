// What a request runs with, as typed values: parsed once where the user gives them (the command
// line, a JSON body) and validated here, in one place; nothing below compares option strings.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "cert/meter.h"
#include "formats/kv_format.h"
#include "gate/policy.h"
#include "kvcache/backing_tier.h"
#include "kvcache/kv_store.h"
#include "model/sampler.h"

namespace witcert::engine {

namespace detail {
inline void require_json(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}
}  // namespace detail

// The limits every JSON value from outside is parsed under (a request body, a batch line, a C API
// option string, a `witcert bound` line): nlohmann's parser is iterative, but copying and dumping
// the value recurse once per level, so depth is bounded where the text is read.
struct JsonLimits {
  int max_depth = 64;                 // nested arrays and objects
  std::size_t max_bytes = 64u << 20;  // of the text
};

// Parses `text` under `limits`. Throws std::invalid_argument saying what is wrong: not JSON (with
// the parser's message), nested deeper than max_depth, or longer than max_bytes.
nlohmann::json parse_json(std::string_view text, const JsonLimits& limits = {});

// j[key] into out when present: a boolean, a string, a whole number within T's range (never
// wrapped into it), or a number. Throws std::invalid_argument naming the key otherwise.
template <class T>
void read_json(const nlohmann::json& j, const char* key, T& out) {
  const auto it = j.find(key);
  if (it == j.end()) return;
  if constexpr (std::is_same_v<T, bool>) {
    detail::require_json(it->is_boolean(), std::string(key) + " must be true or false");
  } else if constexpr (std::is_same_v<T, std::string>) {
    detail::require_json(it->is_string(), std::string(key) + " must be a string");
  } else if constexpr (std::is_integral_v<T>) {
    const std::string range = std::string(key) + " must be a whole number in [" +
                              std::to_string(std::numeric_limits<T>::min()) + ", " +
                              std::to_string(std::numeric_limits<T>::max()) + "]";
    detail::require_json(it->is_number_integer(), range);
    if (it->is_number_unsigned()) {
      detail::require_json(it->get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<T>::max()), range);
    } else {
      const std::int64_t v = it->get<std::int64_t>();
      detail::require_json(v >= 0 || std::is_signed_v<T>, range);
      if constexpr (std::is_signed_v<T>)
        detail::require_json(v >= std::numeric_limits<T>::min() && v <= std::numeric_limits<T>::max(), range);
    }
  } else {
    detail::require_json(it->is_number(), std::string(key) + " must be a number");
  }
  out = it->get<T>();
}

// A 64-bit unsigned integer (a seed) as the command line gives it: decimal digits, or 0x and hex
// digits; no sign, fraction, exponent or space. Throws std::invalid_argument naming `what` for
// anything else and for values of 2^64 and above, which are never wrapped or saturated.
std::uint64_t parse_u64(std::string_view text, const std::string& what);

// τ_K of the coverage figures where neither the user nor a gate gives one.
inline constexpr double kDefaultCoverageTau = 0.2;
// τ_V of the coverage figures where the user gives none.
inline constexpr double kDefaultCoverageTauV = 0.05;

// The τ_K of a request's coverage figures, the one rule of every entry point (generate, run,
// batch and its lines, serve and its requests): `asked` when given; else the gate's τ_K when the
// gate certifies (0 < τ_K < 1), so that the figures count the cells the gate held to it; else
// `otherwise`, the coverage τ of the level above (a batch's or server's, for its requests).
double coverage_tau(const gate::Policy& gate, std::optional<double> asked, double otherwise = kDefaultCoverageTau);

// The KV cache: the plain exact cache, or the certified cache with its formats, meter and gate.
struct CacheOptions {
  bool certified = false;  // false: the plain exact fp16 cache (no meter); everything below is ignored
  formats::KvFormat k_format, v_format;
  int page_size = 16;
  int outliers = 4;  // m, dither-int8 keys
  kvcache::DitherMode dither = kvcache::DitherMode::shared_prompt;
  // Dithered keys: what one scale covers (kvcache::CacheConfig::key_scales).
  formats::ScaleGranularity key_scales = formats::ScaleGranularity::token;
  std::uint64_t dither_seed = 0x5EED;
  double delta = 1e-2;  // δ_req of Tier B
  cert::BoundShape bound = cert::BoundShape::min;
  gate::Policy gate;
  bool check_soundness = false;
  kvcache::BackingPlace backing;  // where the exact tier lives when the gate or the check keeps one

  // Throws std::invalid_argument naming the setting: page size not in [1, 4096], outliers not in
  // [0, 31], δ not in (0, 1), an impossible τ_K or τ_V, a named backing file nothing reads.
  // The format of one side as the reports name it: its KvFormat name, or "exact" for the plain cache.
  std::string format_name(formats::KvSide side) const;
  void validate() const;
  // Keys: certified (implied by kv), kv, kv_v, page_size, outliers, dither, key_scales, dither_seed, delta,
  // bound, tau_k (τ_K; absent or 0: no gate), tau_v, granularity, check_soundness, exact_tier
  // ("ram" or "file"). Unknown keys, wrong types and bad values throw std::invalid_argument.
  // With `external`, kv and kv_v may also name "external": the caller's own reconstructions
  // (formats/external), which only the C API writes.
  static CacheOptions from_json(const nlohmann::json& j, bool external = false);
  // The settings a request may give over its pool's options, from JSON: tau_k, tau_v,
  // granularity, delta and bound, each optional (absent keys leave the field as it is). The one
  // reader of these keys: from_json, the server's `witcert` object and batch lines all use it.
  // Throws std::invalid_argument naming the key for a wrong type or an unknown name; the ranges
  // are validate()'s.
  void read_policy(const nlohmann::json& j);
  static constexpr const char* kPolicyKeys[] = {"tau_k", "tau_v", "granularity", "delta", "bound"};
};

// A request's meter policy over its pool's: the cache options with the request's gate, δ and
// bound, and the τ of its coverage figures.
struct RequestPolicy {
  CacheOptions cache;
  double coverage_tau = kDefaultCoverageTau;
  double coverage_tau_v = kDefaultCoverageTauV;

  // From a request's JSON object (a server request's `witcert` object, a batch line): the keys of
  // CacheOptions::read_policy and coverage_tau, coverage_tau_v, each optional, over the pool's
  // options `base` and coverage figures. Throws std::invalid_argument naming the key (policy keys
  // without a certified cache, wrong types, values out of range).
  static RequestPolicy from_json(const nlohmann::json& j, const CacheOptions& base, double coverage_tau,
                                 double coverage_tau_v);
  // Every key from_json reads, in the order error messages list them.
  static constexpr const char* kKeys[] = {"tau_k", "tau_v", "granularity", "delta", "bound", "coverage_tau",
                                          "coverage_tau_v"};
};

// One request: the prompt, the token budget, sampling, and how its meter is summarised.
struct RequestOptions {
  std::string prompt;
  bool chat = false;  // wrap the prompt as a user turn of the chat template
  int max_new_tokens = 128;
  model::SamplerConfig sampler;
  double coverage_tau = kDefaultCoverageTau;  // τ_K of the coverage figures
  double coverage_tau_v = kDefaultCoverageTauV;  // τ_V of the coverage figures

  // Throws std::invalid_argument: an empty prompt, a budget outside [0, 1e6], a temperature not
  // finite and ≥ 0, top_p ∉ (0, 1], a coverage τ ∉ (0, 1], τ_V not finite and > 0.
  void validate() const;
  // Keys: prompt (required), chat, max_tokens, temperature, top_p, seed, coverage_tau,
  // coverage_tau_v; as CacheOptions::from_json for anything else.
  static RequestOptions from_json(const nlohmann::json& j);
};

// The engine: the model, its threads and its cache.
struct EngineOptions {
  std::string model;  // GGUF path; "" → default_model_path()
  int threads = 2;
  CacheOptions cache;

  // Throws std::invalid_argument for threads ∉ [1, 256] or a bad cache setting.
  void validate() const;
  // Keys: model, threads, cache (an object for CacheOptions::from_json).
  static EngineOptions from_json(const nlohmann::json& j);
};

}  // namespace witcert::engine
