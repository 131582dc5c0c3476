// A fixed pool of worker threads running one parallel loop at a time. The calling thread takes
// part in the work, so a pool of size 1 runs everything inline with no synchronization.
//
// A decode step issues a few hundred short loops (one per weight matrix), so waking sleeping
// threads through a condition variable for each (~50 µs here) would cost more than the work.
// Workers and the caller therefore spin briefly on atomics before they block.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace witcert {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end, worker) over a partition of [0, n) into at most size() contiguous
  // chunks, one per participating thread, and returns when all are done. worker ∈ [0, size()).
  // Not reentrant: one loop at a time.
  void parallel_for(std::int64_t n, const std::function<void(std::int64_t, std::int64_t, int)>& fn);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(std::int64_t, std::int64_t, int)>* job_ = nullptr;
  std::int64_t n_ = 0;
  std::atomic<std::uint64_t> generation_{0};  // bumped to publish a new loop
  std::atomic<int> pending_{0};               // workers still running the current loop
  std::atomic<bool> stop_{false};
};

}  // namespace witcert
