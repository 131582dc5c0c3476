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

bool finite_positive(double v) { return std::isfinite(v) && v > 0; }

}  // namespace

nlohmann::json parse_json(std::string_view text, const JsonLimits& limits) {
  require(text.size() <= limits.max_bytes,
          "the JSON text has " + std::to_string(text.size()) + " bytes; at most " + std::to_string(limits.max_bytes));
  // The callback sees each value's depth before it is built; throwing there stops the parse.
  const auto depth_check = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json&) {
    if ((event == nlohmann::json::parse_event_t::object_start || event == nlohmann::json::parse_event_t::array_start) &&
        depth >= limits.max_depth)
      throw std::invalid_argument("the JSON text nests deeper than " + std::to_string(limits.max_depth) + " levels");
    return true;
  };
  try {
    return nlohmann::json::parse(text, depth_check);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("not valid JSON: ") + e.what());
  }
}

std::uint64_t parse_u64(std::string_view text, const std::string& what) {
  const bool hex = text.size() > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X');
  const std::string_view digits = hex ? text.substr(2) : text;
  const unsigned base = hex ? 16 : 10;
  const std::string wanted = what + ": '" + std::string(text) + "' is not a whole number in [0, 2^64) (decimal or 0x-hex)";
  require(!digits.empty(), wanted);
  std::uint64_t v = 0;
  for (const char c : digits) {
    unsigned d = base;
    if (c >= '0' && c <= '9') d = static_cast<unsigned>(c - '0');
    else if (hex && c >= 'a' && c <= 'f') d = static_cast<unsigned>(c - 'a' + 10);
    else if (hex && c >= 'A' && c <= 'F') d = static_cast<unsigned>(c - 'A' + 10);
    require(d < base, wanted);
    require(v <= (std::numeric_limits<std::uint64_t>::max() - d) / base, wanted);
    v = v * base + d;
  }
  return v;
}

double coverage_tau(const gate::Policy& gate, std::optional<double> asked, double otherwise) {
  if (asked) return *asked;
  if (gate.on() && gate.certified()) return gate.tau_k();
  return otherwise;
}

std::string CacheOptions::format_name(formats::KvSide side) const {
  if (!certified) return "exact";
  return std::string(side == formats::KvSide::key ? k_format.name() : v_format.name());
}

void CacheOptions::validate() const {
  if (!certified) return;
  require(page_size >= 1 && page_size <= 4096, "page_size must be in [1, 4096], got " + std::to_string(page_size));
  require(outliers >= 0 && outliers <= 31, "outliers must be in [0, 31], got " + std::to_string(outliers));
  require(delta > 0 && delta < 1, "delta must be in (0, 1), got " + std::to_string(delta));
  gate.validate();
  require(backing.path.empty() || gate.on() || check_soundness,
          "backing file: nothing reads the exact tier without a gate (tau_k) or the soundness check");
}

CacheOptions CacheOptions::from_json(const nlohmann::json& j, bool external) {
  check_keys(j,
             {"kv", "kv_v", "page_size", "outliers", "dither", "key_scales", "dither_seed", "delta", "bound", "tau_k", "tau_v",
              "granularity", "check_soundness", "exact_tier"},
             "cache");
  CacheOptions o;
  std::string kv, kv_v, dither, key_scales, exact_tier;
  read_json(j, "kv", kv);
  read_json(j, "kv_v", kv_v);
  o.certified = !kv.empty();
  if (!o.certified)
    for (const auto& [key, value] : j.items())
      require(key == "kv", key + " needs kv: without it the engine keeps a plain exact cache");
  if (o.certified) {
    const auto format = [&](const std::string& name) {
      return external && name == "external" ? formats::KvFormat::external() : formats::KvFormat::parse(name);
    };
    o.k_format = format(kv);
    o.v_format = format(kv_v.empty() ? kv : kv_v);
  }
  read_json(j, "page_size", o.page_size);
  read_json(j, "outliers", o.outliers);
  if (read_json(j, "dither", dither), !dither.empty()) o.dither = kvcache::parse_dither_mode(dither);
  if (read_json(j, "key_scales", key_scales), !key_scales.empty())
    o.key_scales = formats::parse_scale_granularity(key_scales);
  read_json(j, "dither_seed", o.dither_seed);
  o.read_policy(j);
  read_json(j, "check_soundness", o.check_soundness);
  read_json(j, "exact_tier", exact_tier);
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
  require(sampler.top_k >= 0, "top_k must be >= 0 (0: every token), got " + std::to_string(sampler.top_k));
  require(coverage_tau > 0 && coverage_tau <= 1, "coverage_tau must be in (0, 1], got " + std::to_string(coverage_tau));
  require(finite_positive(coverage_tau_v), "coverage_tau_v must be finite and > 0, got " + std::to_string(coverage_tau_v));
}

void CacheOptions::read_policy(const nlohmann::json& j) {
  double tau_k = gate.tau_k();
  read_json(j, "tau_k", tau_k);
  gate.set_tau_k(tau_k);
  read_json(j, "tau_v", gate.tau_v);
  if (j.contains("granularity")) {
    std::string name;
    read_json(j, "granularity", name);
    gate.granularity = gate::parse_granularity(name);
  }
  read_json(j, "delta", delta);
  if (j.contains("bound")) {
    std::string name;
    read_json(j, "bound", name);
    bound = cert::parse_bound_shape(name);
  }
}

// RequestPolicy's keys begin with CacheOptions::read_policy's.
static_assert([] {
  for (std::size_t i = 0; i < std::size(CacheOptions::kPolicyKeys); ++i)
    if (std::string_view(RequestPolicy::kKeys[i]) != CacheOptions::kPolicyKeys[i]) return false;
  return std::size(RequestPolicy::kKeys) == std::size(CacheOptions::kPolicyKeys) + 2;
}());

RequestPolicy RequestPolicy::from_json(const nlohmann::json& j, const CacheOptions& base, double coverage_tau,
                                       double coverage_tau_v) {
  RequestPolicy p{base, coverage_tau, coverage_tau_v};
  bool policy = false;
  for (const char* key : kKeys) policy = policy || j.contains(key);
  require(!policy || base.certified,
          "tau_k, tau_v, granularity, delta, bound and coverage figures need a certified cache (kv)");
  // δ is the failure budget of Tier B's keys: on any other key format it would change nothing.
  require(!j.contains("delta") || base.k_format.kind() == formats::FormatKind::dither,
          "delta is the failure budget of dithered keys (dither-int4/5/6/8); the pool's keys are " +
              std::string(base.k_format.name()) + ", whose bound holds for every query (no delta)");
  p.cache.read_policy(j);
  // The request's coverage τ, by the rule of every entry point: its own, else its own certified
  // gate's τ_K, else the pool's.
  std::optional<double> asked;
  if (j.contains("coverage_tau")) read_json(j, "coverage_tau", asked.emplace());
  p.coverage_tau = engine::coverage_tau(j.contains("tau_k") ? p.cache.gate : gate::Policy{}, asked, coverage_tau);
  read_json(j, "coverage_tau_v", p.coverage_tau_v);
  require(p.coverage_tau > 0 && p.coverage_tau <= 1, "coverage_tau must be in (0, 1]");
  require(finite_positive(p.coverage_tau_v), "coverage_tau_v must be finite and > 0");
  p.cache.validate();
  return p;
}

RequestOptions RequestOptions::from_json(const nlohmann::json& j) {
  check_keys(j, {"prompt", "chat", "max_tokens", "temperature", "top_p", "top_k", "seed", "coverage_tau", "coverage_tau_v"},
             "request");
  require(j.contains("prompt"), "request: prompt is required");
  RequestOptions o;
  read_json(j, "prompt", o.prompt);
  read_json(j, "chat", o.chat);
  read_json(j, "max_tokens", o.max_new_tokens);
  read_json(j, "temperature", o.sampler.temperature);
  read_json(j, "top_p", o.sampler.top_p);
  read_json(j, "top_k", o.sampler.top_k);
  read_json(j, "seed", o.sampler.seed);
  read_json(j, "coverage_tau", o.coverage_tau);
  read_json(j, "coverage_tau_v", o.coverage_tau_v);
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
  read_json(j, "model", o.model);
  read_json(j, "threads", o.threads);
  if (j.contains("cache")) o.cache = CacheOptions::from_json(j["cache"]);
  o.validate();
  return o;
}

}  // namespace witcert::engine
