// Test support: holds the kernel to "allocates nothing once warm" on one store's (layer 0, KV head
// 0), under the SIMD target the caller has selected.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "attention/cpu/attend.h"
#include "base/alloc_counter.h"

namespace witcert::kernel {

// A call over [0, n) grows a fresh workspace and partials; further calls over inner ranges, with
// the meter on and off, must allocate nothing. `label` names the case in a failure.
inline void expect_warm_attend_allocates_nothing(kvcache::KvStore::Reader& r, int group, int d, std::int64_t n,
                                                 const std::string& label) {
  std::vector<float> q(group * d);
  for (int c = 0; c < group * d; ++c) q[c] = 0.05f * static_cast<float>((c * 7) % 11) - 0.2f;
  const attention::BoundContext ctx{0.125, n, 1e-6};
  Workspace work;
  std::vector<attention::HeadPartial> partials;
  for (bool meter : {true, false}) {
    attend_range(work, r, q.data(), group, d, 0, n, ctx, partials, meter);  // grows work and partials
    for (const auto& [b, e] : {std::pair<std::int64_t, std::int64_t>{0, n}, {17, 250}, {n - 1, n}}) {
      const attention::HeadPartial fresh;
      for (attention::HeadPartial& p : partials) p = fresh;  // a copy keeps each acc's capacity
      const long before = testing_util::thread_allocations();
      attend_range(work, r, q.data(), group, d, b, e, ctx, partials, meter);
      EXPECT_EQ(testing_util::thread_allocations() - before, 0)
          << label << " meter " << meter << " [" << b << ", " << e << ")";
    }
  }
}

}  // namespace witcert::kernel
