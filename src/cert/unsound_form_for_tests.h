// The plausible but UNSOUND certificate of paper §3, eq. (1). Tests only: it is the
// counterexample guard and the negative control that shows the adversarial suite can catch
// an unsound bound. Never include this outside *_test.cc.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>

namespace witcert::cert::testing {

// ½ e^{2 c_max} (E_p̃|c − c̄| + c̄ (e^{c_max} − 1)), c̄ = E_p̃[c].
inline double unsound_form(std::span<const double> p_tilde, std::span<const double> c) {
  double c_bar = 0.0, c_max = 0.0;
  for (std::size_t t = 0; t < c.size(); ++t) {
    c_bar += p_tilde[t] * c[t];
    c_max = std::max(c_max, c[t]);
  }
  double dispersion = 0.0;
  for (std::size_t t = 0; t < c.size(); ++t) dispersion += p_tilde[t] * std::fabs(c[t] - c_bar);
  return 0.5 * std::exp(2.0 * c_max) * (dispersion + c_bar * std::expm1(c_max));
}

}  // namespace witcert::cert::testing
