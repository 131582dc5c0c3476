// One accumulator per thread, so that the attention path records without a lock: a thread takes
// the lock only the first time it records into an instance; readers merge the shards after the
// forward passes that wrote them (never while one runs).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace witcert::gate {

template <class T>
class PerThread {
 public:
  explicit PerThread(T prototype = T{}) : prototype_(std::move(prototype)) {}
  PerThread(const PerThread&) = delete;
  PerThread& operator=(const PerThread&) = delete;

  // This thread's shard (a copy of the prototype when first used).
  T& local() {
    thread_local Last last;
    if (last.owner == id_) return *static_cast<T*>(last.shard);
    std::lock_guard<std::mutex> lock(mu_);
    const std::thread::id me = std::this_thread::get_id();
    T* shard = nullptr;
    for (auto& [tid, s] : shards_)
      if (tid == me) shard = s.get();
    if (!shard) shard = shards_.emplace_back(me, std::make_unique<T>(prototype_)).second.get();
    last = {id_, shard};
    return *shard;
  }

  // Calls f on every shard, in the order the threads first recorded.
  template <class F>
  void for_each(F&& f) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& entry : shards_) f(static_cast<const T&>(*entry.second));
  }

 private:
  struct Last {
    std::uint64_t owner = 0;
    void* shard = nullptr;
  };
  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> n{0};
    return ++n;
  }

  const std::uint64_t id_ = next_id();  // never reused, unlike an address
  T prototype_;
  mutable std::mutex mu_;
  std::vector<std::pair<std::thread::id, std::unique_ptr<T>>> shards_;
};

}  // namespace witcert::gate
