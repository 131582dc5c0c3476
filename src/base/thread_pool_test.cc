#include "base/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace witcert {
namespace {

TEST(ThreadPool, CoversEveryIndexOnceForManySizes) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (std::int64_t n : {0, 1, 2, 7, 100, 1001}) {
      std::vector<std::atomic<int>> hits(n);
      std::atomic<int> max_worker{0};
      for (int rep = 0; rep < 20; ++rep) {
        pool.parallel_for(n, [&](std::int64_t b, std::int64_t e, int w) {
          for (std::int64_t i = b; i < e; ++i) ++hits[i];
          int m = max_worker.load();
          while (w > m && !max_worker.compare_exchange_weak(m, w)) {
          }
        });
      }
      for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 20) << threads << " " << n << " " << i;
      EXPECT_LT(max_worker.load(), threads);
    }
  }
}

}  // namespace
}  // namespace witcert
