// The Prometheus exposition: known-answer text for a counter with labels, a gauge and a
// histogram (cumulative buckets, +Inf, _sum, _count).
#include "apps/serve/metrics.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace witcert::apps {
namespace {

TEST(Metrics, ExpositionIsPrometheusText) {
  Metrics m;
  m.counter("x_requests_total", "Requests.");
  m.gauge("x_running", "Running.");
  m.histogram("x_seconds", "Latency.", {0.25, 1.0});
  m.add("x_requests_total", 2, {{"finish_reason", "stop"}});
  m.add("x_requests_total", 1, {{"finish_reason", "stop"}});
  m.add("x_requests_total", 1, {{"finish_reason", "len\"gth"}});
  m.set("x_running", 4);
  m.observe("x_seconds", 0.125);
  m.observe("x_seconds", 0.25);  // le is inclusive
  m.observe("x_seconds", 3.0);
  m.observe_counts("x_seconds", {1, 0, 2}, 0.5);
  EXPECT_EQ(m.exposition(),
            "# HELP x_requests_total Requests.\n"
            "# TYPE x_requests_total counter\n"
            "x_requests_total{finish_reason=\"len\\\"gth\"} 1\n"
            "x_requests_total{finish_reason=\"stop\"} 3\n"
            "# HELP x_running Running.\n"
            "# TYPE x_running gauge\n"
            "x_running 4\n"
            "# HELP x_seconds Latency.\n"
            "# TYPE x_seconds histogram\n"
            "x_seconds_bucket{le=\"0.25\"} 3\n"
            "x_seconds_bucket{le=\"1\"} 3\n"
            "x_seconds_bucket{le=\"+Inf\"} 6\n"
            "x_seconds_sum 3.875\n"
            "x_seconds_count 6\n");
  EXPECT_EQ(m.value("x_requests_total", {{"finish_reason", "stop"}}), 3.0);
  EXPECT_EQ(m.value("x_requests_total", {{"finish_reason", "error"}}), 0.0);
  EXPECT_THROW(m.add("x_running", 1), std::logic_error);  // a gauge is not a counter
  EXPECT_THROW(m.observe_counts("x_seconds", {1, 2}, 0.0), std::logic_error);
}

}  // namespace
}  // namespace witcert::apps
