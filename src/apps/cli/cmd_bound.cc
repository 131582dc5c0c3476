#include <cmath>
#include <istream>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/cli/commands.h"
#include "cert/meter.h"
#include "engine/options.h"

namespace witcert::apps {
namespace {

using nlohmann::json;

constexpr double kDistributionTolerance = 1e-9;

std::vector<double> number_array(const json& obj, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end()) throw std::invalid_argument(std::string("missing \"") + key + "\"");
  if (!it->is_array()) throw std::invalid_argument(std::string("\"") + key + "\" is not an array");
  std::vector<double> v;
  v.reserve(it->size());
  for (const auto& x : *it) {
    if (!x.is_number()) throw std::invalid_argument(std::string("\"") + key + "\" holds a non-number");
    v.push_back(x.get<double>());
  }
  return v;
}

json number(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

// Every bound shape, the raw score (the e-form) and the meter: the fields of the C API's witcert_bounds.
json bounds_json(const cert::Bounds& b) {
  return {{"eform", number(b.eform)},         {"two_sided", number(b.two_sided)},
          {"retention", number(b.retention)}, {"tanh", number(b.tanh)},
          {"tanh_half", number(b.tanh_half)}, {"raw", number(b.eform)},
          {"meter", number(b.meter())}};
}

json bound_line(const std::string& line) {
  const json in = engine::parse_json(line);  // throws std::invalid_argument on malformed or too deep input
  if (!in.is_object()) throw std::invalid_argument("not a JSON object");
  if (in.contains("z") == in.contains("p_tilde")) throw std::invalid_argument("give either \"z\" or \"p_tilde\"");
  const std::vector<double> c = number_array(in, "c");
  if (in.contains("z")) {
    // Logits: the same bounds from the log domain, as the C API's witcert_meter_logits.
    if (in.contains("eps")) throw std::invalid_argument("\"eps\" (the true TV) needs \"p_tilde\"");
    const std::vector<double> z = number_array(in, "z");
    if (z.empty()) throw std::invalid_argument("\"z\" is empty");
    if (c.size() != z.size())
      throw std::invalid_argument("\"c\" has " + std::to_string(c.size()) + " entries, \"z\" has " +
                                  std::to_string(z.size()));
    for (std::size_t t = 0; t < z.size(); ++t) {
      if (!std::isfinite(z[t])) throw std::invalid_argument("z[" + std::to_string(t) + "] is not finite");
      if (!(c[t] >= 0.0)) throw std::invalid_argument("c[" + std::to_string(t) + "] is negative");
    }
    return bounds_json(cert::evaluate_logits(z, c));
  }
  const std::vector<double> p = number_array(in, "p_tilde");
  if (p.empty()) throw std::invalid_argument("\"p_tilde\" is empty");
  if (c.size() != p.size())
    throw std::invalid_argument("\"c\" has " + std::to_string(c.size()) + " entries, \"p_tilde\" has " +
                                std::to_string(p.size()));
  double total = 0.0;
  for (std::size_t t = 0; t < p.size(); ++t) {
    if (!(p[t] >= 0.0) || !std::isfinite(p[t]))
      throw std::invalid_argument("p_tilde[" + std::to_string(t) + "] is negative or not finite");
    if (!(c[t] >= 0.0)) throw std::invalid_argument("c[" + std::to_string(t) + "] is negative");
    total += p[t];
  }
  if (std::fabs(total - 1.0) > kDistributionTolerance)
    throw std::invalid_argument("p_tilde sums to " + std::to_string(total) + ", not 1 within 1e-9");

  std::vector<double> eps;
  if (in.contains("eps")) {
    eps = number_array(in, "eps");
    if (eps.size() != p.size())
      throw std::invalid_argument("\"eps\" has " + std::to_string(eps.size()) + " entries, \"p_tilde\" has " +
                                  std::to_string(p.size()));
    for (std::size_t t = 0; t < p.size(); ++t)
      if (!(std::fabs(eps[t]) <= c[t]))
        throw std::invalid_argument("|eps[" + std::to_string(t) + "]| exceeds c[" + std::to_string(t) + "]");
  }

  json out = bounds_json(cert::evaluate(p, c));
  if (!eps.empty()) out["tv"] = number(cert::true_tv(p, eps));
  return out;
}

}  // namespace

int run_bound(std::istream& in, std::ostream& out) {
  std::string line;
  long line_no = 0;
  bool any_failed = false;
  while (std::getline(in, line)) {
    ++line_no;
    json result;
    try {
      result = bound_line(line);
    } catch (const std::exception& e) {
      any_failed = true;
      result = {{"line", line_no}, {"error", e.what()}};
    }
    out << result.dump() << "\n";
  }
  return any_failed ? 1 : 0;
}

}  // namespace witcert::apps
