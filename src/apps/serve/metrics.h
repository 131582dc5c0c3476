// The server's Prometheus metrics: counters, gauges and histograms with labels, written in the
// text exposition format (version 0.0.4). Thread-safe: handlers and the engine thread update it,
// the /metrics handler reads it.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace witcert::apps {

class Metrics {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;

  // Declares a family once (name with its unit suffix, help text); histograms take their upper
  // bucket bounds, ascending (+Inf is added).
  void counter(const std::string& name, const std::string& help);
  void gauge(const std::string& name, const std::string& help);
  void histogram(const std::string& name, const std::string& help, std::vector<double> bounds);

  void add(const std::string& name, double v, const Labels& labels = {});   // counter
  void set(const std::string& name, double v, const Labels& labels = {});   // gauge
  void observe(const std::string& name, double v, const Labels& labels = {});  // histogram
  // A histogram's buckets added at once: counts[i] observations in bucket i (the last is +Inf),
  // their sum `sum`.
  void observe_counts(const std::string& name, const std::vector<std::int64_t>& counts, double sum,
                      const Labels& labels = {});

  double value(const std::string& name, const Labels& labels = {}) const;  // counter or gauge; 0 if unset
  std::string exposition() const;

 private:
  enum class Kind { counter, gauge, histogram };
  struct Series {
    double value = 0.0;               // counter, gauge
    std::vector<std::int64_t> counts;  // histogram: per bucket, not cumulative
    double sum = 0.0;
  };
  struct Family {
    Kind kind;
    std::string help;
    std::vector<double> bounds;
    std::map<Labels, Series> series;
  };
  Family& family(const std::string& name, Kind kind);
  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
  std::vector<std::string> order_;  // declaration order, for a stable exposition
};

}  // namespace witcert::apps
