#include "apps/serve/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace witcert::apps {
namespace {

// A sample value as Prometheus reads it: shortest round-trip decimal, +Inf/-Inf/NaN spelled out.
std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string label_text(const Metrics::Labels& labels, const std::string& extra = "") {
  std::string out;
  for (const auto& [k, v] : labels) out += (out.empty() ? "" : ",") + k + "=\"" + escape(v) + "\"";
  if (!extra.empty()) out += (out.empty() ? "" : ",") + extra;
  return out.empty() ? "" : "{" + out + "}";
}

}  // namespace

Metrics::Family& Metrics::family(const std::string& name, Kind kind) {
  const auto it = families_.find(name);
  if (it == families_.end() || it->second.kind != kind) throw std::logic_error("metric " + name + " is not declared so");
  return it->second;
}

void Metrics::counter(const std::string& name, const std::string& help) {
  std::lock_guard lock(mu_);
  if (families_.emplace(name, Family{Kind::counter, help, {}, {}}).second) order_.push_back(name);
}

void Metrics::gauge(const std::string& name, const std::string& help) {
  std::lock_guard lock(mu_);
  if (families_.emplace(name, Family{Kind::gauge, help, {}, {}}).second) order_.push_back(name);
}

void Metrics::histogram(const std::string& name, const std::string& help, std::vector<double> bounds) {
  if (!std::is_sorted(bounds.begin(), bounds.end())) throw std::logic_error("histogram bounds must ascend");
  std::lock_guard lock(mu_);
  if (families_.emplace(name, Family{Kind::histogram, help, std::move(bounds), {}}).second) order_.push_back(name);
}

void Metrics::add(const std::string& name, double v, const Labels& labels) {
  std::lock_guard lock(mu_);
  family(name, Kind::counter).series[labels].value += v;
}

void Metrics::set(const std::string& name, double v, const Labels& labels) {
  std::lock_guard lock(mu_);
  family(name, Kind::gauge).series[labels].value = v;
}

void Metrics::observe(const std::string& name, double v, const Labels& labels) {
  std::lock_guard lock(mu_);
  Family& f = family(name, Kind::histogram);
  Series& s = f.series[labels];
  s.counts.resize(f.bounds.size() + 1);
  const std::size_t b = std::lower_bound(f.bounds.begin(), f.bounds.end(), v) - f.bounds.begin();
  s.counts[b] += 1;
  s.sum += v;
}

void Metrics::observe_counts(const std::string& name, const std::vector<std::int64_t>& counts, double sum,
                             const Labels& labels) {
  std::lock_guard lock(mu_);
  Family& f = family(name, Kind::histogram);
  if (counts.size() != f.bounds.size() + 1) throw std::logic_error("histogram " + name + ": wrong bucket count");
  Series& s = f.series[labels];
  s.counts.resize(f.bounds.size() + 1);
  for (std::size_t i = 0; i < counts.size(); ++i) s.counts[i] += counts[i];
  s.sum += sum;
}

double Metrics::value(const std::string& name, const Labels& labels) const {
  std::lock_guard lock(mu_);
  const auto it = families_.find(name);
  if (it == families_.end()) return 0.0;
  const auto s = it->second.series.find(labels);
  return s == it->second.series.end() ? 0.0 : s->second.value;
}

std::string Metrics::exposition() const {
  std::lock_guard lock(mu_);
  std::string out;
  for (const std::string& name : order_) {
    const Family& f = families_.at(name);
    const char* type = f.kind == Kind::counter ? "counter" : f.kind == Kind::gauge ? "gauge" : "histogram";
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, f.help, name, type);
    for (const auto& [labels, s] : f.series) {
      if (f.kind != Kind::histogram) {
        out += name + label_text(labels) + " " + number(s.value) + "\n";
        continue;
      }
      std::int64_t cumulative = 0;
      for (std::size_t b = 0; b <= f.bounds.size(); ++b) {
        cumulative += b < s.counts.size() ? s.counts[b] : 0;
        const std::string le = b < f.bounds.size() ? number(f.bounds[b]) : "+Inf";
        out += name + "_bucket" + label_text(labels, "le=\"" + le + "\"") + " " + std::to_string(cumulative) + "\n";
      }
      out += name + "_sum" + label_text(labels) + " " + number(s.sum) + "\n";
      out += name + "_count" + label_text(labels) + " " + std::to_string(cumulative) + "\n";
    }
  }
  return out;
}

}  // namespace witcert::apps
