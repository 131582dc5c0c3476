#include "base/alloc_counter.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
thread_local long thread_count = 0;
std::atomic<long> process_count{0};

void* counted(std::size_t n) noexcept {
  ++thread_count;
  process_count.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
}  // namespace

namespace witcert::testing_util {
long thread_allocations() { return thread_count; }
long process_allocations() { return process_count.load(std::memory_order_relaxed); }
}  // namespace witcert::testing_util

// Every allocation of the test binary passes here.
void* operator new(std::size_t n) {
  if (void* p = counted(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
// The nothrow forms too (std::stable_sort's buffer): every form this binary frees with free().
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted(n); }
// GCC takes the free below for a mismatch with the operator new it pairs with; it is this new's.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
#pragma GCC diagnostic pop
