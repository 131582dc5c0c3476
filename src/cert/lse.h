// Streaming log-sum-exp, mergeable across split-KV partitions.
#pragma once

#include <cmath>
#include <limits>

namespace witcert::cert {

// LSE_t(x_t) held as (m, s) with LSE = m + log s, s = Σ_t e^{x_t − m}. Partial sums from
// disjoint token ranges merge exactly like the attention output's softmax statistics.
struct Lse {
  double m = -std::numeric_limits<double>::infinity();
  double s = 0.0;

  void add(double x) {
    if (std::isnan(x) || std::isnan(m)) {
      m = std::numeric_limits<double>::quiet_NaN();
      return;
    }
    if (x == -std::numeric_limits<double>::infinity()) return;
    if (x == std::numeric_limits<double>::infinity() || m == std::numeric_limits<double>::infinity()) {
      m = std::numeric_limits<double>::infinity();
      s = 1.0;
      return;
    }
    if (x <= m) {
      s += std::exp(x - m);
    } else {
      s = s * std::exp(m - x) + 1.0;
      m = x;
    }
  }

  void merge(const Lse& o) {
    if (std::isnan(o.m) || std::isnan(m)) {
      m = std::numeric_limits<double>::quiet_NaN();
      return;
    }
    if (o.s == 0.0) return;
    if (s == 0.0 || o.m == std::numeric_limits<double>::infinity()) {
      *this = o;
      return;
    }
    if (m == std::numeric_limits<double>::infinity()) return;
    if (o.m <= m) {
      s += o.s * std::exp(o.m - m);
    } else {
      s = s * std::exp(m - o.m) + o.s;
      m = o.m;
    }
  }

  // −inf for an empty sum, NaN if any term was NaN.
  double value() const { return s == 0.0 && !std::isnan(m) ? m : m + std::log(s); }
};

}  // namespace witcert::cert
