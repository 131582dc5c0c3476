#include "base/thread_pool.h"

#include <algorithm>

namespace witcert {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < std::max(1, threads); ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

namespace {
std::pair<std::int64_t, std::int64_t> chunk(std::int64_t n, int parts, int i) {
  return {n * i / parts, n * (i + 1) / parts};
}
}  // namespace

void ThreadPool::parallel_for(std::int64_t n, const std::function<void(std::int64_t, std::int64_t, int)>& fn) {
  if (n <= 0) return;
  const int parts = static_cast<int>(std::min<std::int64_t>(size(), n));
  if (parts == 1) {
    fn(0, n, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    n_ = n;
    pending_ = size() - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  const auto [b, e] = chunk(n, size(), 0);
  if (b < e) fn(b, e, 0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::worker_loop(int index) {
  std::uint64_t seen = 0;
  while (true) {
    const std::function<void(std::int64_t, std::int64_t, int)>* job;
    std::int64_t n;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = n_;
    }
    const auto [b, e] = chunk(n, size(), index);
    if (b < e) (*job)(b, e, index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace witcert
