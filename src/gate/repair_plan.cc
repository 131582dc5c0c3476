#include "gate/repair_plan.h"

#include <algorithm>
#include <cmath>

namespace witcert::gate {

bool plan_blocks(kvcache::KvStore::Reader& reader, const float* q, int head_dim, std::int64_t begin, std::int64_t end,
                 const attention::BoundContext& ctx, const Policy& policy, std::span<const attention::HeadPartial> partials,
                 std::span<const attention::HeadResult> results, std::vector<std::int64_t>& order) {
  const int group = static_cast<int>(partials.size());
  std::vector<double> lse_z(group), A(group), rho(group);
  for (int h = 0; h < group; ++h) {
    lse_z[h] = partials[h].meter.z.value();
    A[h] = std::exp(partials[h].meter.log_A());
    // The V meter times max‖v‖: Σ p̃ ρ^v with its float allowance, the quantity the pages' terms add up to
    // (or, for values with their own dither, Tier B's smaller term: the plan may then stop short, and
    // the gate's next round, which recomputes the meter, goes on).
    rho[h] = results[h].v_meter * partials[h].v_max;
  }
  const attention::PageTerms terms = attention::page_contributions(reader, q, group, head_dim, begin, end, ctx, lse_z);
  const auto total = [group](const std::vector<std::vector<double>>& t, std::int64_t j) {
    double s = 0.0;
    for (int h = 0; h < group; ++h) s += t[h][j];
    return s;
  };
  const auto all_finite = [&](const std::vector<double>& per_head, const std::vector<std::vector<double>>& t) {
    return std::all_of(per_head.begin(), per_head.end(), [](double a) { return std::isfinite(a); }) &&
           std::all_of(order.begin(), order.end(), [&](std::int64_t j) { return std::isfinite(total(t, j)); });
  };
  if (!all_finite(A, terms.a) || !all_finite(rho, terms.rho)) return false;  // no plan: every page
  const double a_target = std::sqrt(1.0 + 2.0 * policy.tau_k());  // ½(A² − 1) ≤ τ_K
  const auto k_pending = [&] { return std::any_of(A.begin(), A.end(), [&](double a) { return a > a_target; }); };
  const auto v_pending = [&] {
    for (int h = 0; h < group; ++h)
      if (rho[h] > policy.tau_v * partials[h].v_max) return true;
    return false;
  };
  std::vector<std::int64_t> left = order, plan;
  const auto take = [&](const std::vector<std::vector<double>>& t, const auto& pending) {
    std::stable_sort(left.begin(), left.end(), [&](std::int64_t a, std::int64_t b) { return total(t, a) > total(t, b); });
    std::size_t n = 0;
    for (; n < left.size() && pending(); ++n) {
      for (int h = 0; h < group; ++h) {
        A[h] -= terms.a[h][left[n]];
        rho[h] -= terms.rho[h][left[n]];
      }
      plan.push_back(left[n]);
    }
    left.erase(left.begin(), left.begin() + static_cast<std::ptrdiff_t>(n));
  };
  take(terms.a, k_pending);
  take(terms.rho, v_pending);
  if (plan.empty()) plan.push_back(left.front());  // rounding left the plan short: at least one page a round
  order = plan;
  return true;
}

}  // namespace witcert::gate
