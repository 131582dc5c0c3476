// Paged token storage: a pool of fixed-size pages and per-sequence page tables (DESIGN §2, the
// kvcache layer). A page holds page_size token slots of every (layer, KV head); the slot of position
// pos is page_table[pos / page_size]·page_size + pos % page_size. The slot names a token's
// storage; the name its writer gave the page (kept by the pool) names its dither, so neither
// paging nor sharing a page changes what a token reads back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace witcert::kvcache {

// Zero-filled bytes that take address space at once and memory only as they are written: an
// anonymous private mapping without a swap reservation (MAP_NORESERVE) or huge pages, whose
// pages the kernel commits on first write (reads of an unwritten page see zeros and commit
// nothing). Throws std::runtime_error naming the size when the address space cannot be had.
// 0 bytes: nullptr.
void* reserve_zeroed(std::size_t bytes);
void release_reserved(void* p, std::size_t bytes);

// n zero values of T over reserve_zeroed: a pool sized to a memory budget holds the pages its
// sequences have written, not the budget. size() counts every value, written or not (what the
// measured bytes charge). T's zero bytes are its zero value (integers, float, f16).
template <class T>
class ReservedArray {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_default_constructible_v<T>);

 public:
  ReservedArray() = default;
  explicit ReservedArray(std::size_t n)
      : data_(static_cast<T*>(reserve_zeroed(checked_bytes(n)))), size_(n) {}
  ReservedArray(ReservedArray&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  ReservedArray& operator=(ReservedArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    return *this;
  }
  ReservedArray(const ReservedArray&) = delete;
  ReservedArray& operator=(const ReservedArray&) = delete;
  ~ReservedArray() { release_reserved(data_, size_ * sizeof(T)); }

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }

 private:
  static std::size_t checked_bytes(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T))
      throw std::length_error("a reserved array of " + std::to_string(n) + " values overflows");
    return n * sizeof(T);
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

// Every page of the pool is held: the caller may free sequences or preempt one.
struct PoolExhausted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class PagePool {
 public:
  // pages × page_size slots. shuffle_seed ≠ 0 hands pages out in a shuffled order (tests:
  // nothing may depend on physical pages being contiguous or ordered).
  PagePool(std::int64_t pages, int page_size, std::uint64_t shuffle_seed = 0);
  // The same pages, free and taken alike (a copied cache).
  PagePool(const PagePool& other);
  PagePool& operator=(const PagePool&) = delete;

  int page_size() const { return page_size_; }
  std::int64_t pages() const { return pages_; }
  std::int64_t free_pages() const;

  // Thread-safe: the sequences of one pool take and return pages from any thread. Throws
  // std::runtime_error when the pool is exhausted.
  std::int64_t allocate();
  // One more holder of a taken page (a sequence that shares it); release drops one holder, and
  // the page is free again when none is left.
  void share(std::int64_t page);
  void release(std::int64_t page);
  int holders(std::int64_t page) const;

 private:
  std::int64_t pages_;
  int page_size_;
  mutable std::mutex mu_;
  std::vector<std::int64_t> free_;  // a stack: the next page handed out is free_.back()
  std::vector<int> holders_;        // [page]: sequences holding it (0: free)
};

// One sequence's logical pages, mapped to physical pages on demand.
class PageTable {
 public:
  // Room for the pages of `capacity` positions is reserved at once, so that writing a sequence
  // allocates nothing and its measured bytes hold from the start.
  PageTable(PagePool& pool, std::int64_t capacity) : pool_(&pool) {
    pages_.reserve(static_cast<std::size_t>((capacity + pool.page_size() - 1) / pool.page_size()));
  }
  // The same mapping over `pool`, a copy of other's pool (a copied cache), with other's room.
  PageTable(const PageTable& other, PagePool& pool) : pool_(&pool), released_(other.released_) {
    pages_.reserve(other.pages_.capacity());
    pages_ = other.pages_;
  }
  ~PageTable();
  PageTable(const PageTable&) = delete;
  PageTable& operator=(const PageTable&) = delete;

  // Maps this empty table's first `pages` logical pages to `donor`'s physical ones, shared
  // (the donor's table is over the same pool), and released where the donor's are. Throws
  // std::logic_error otherwise.
  void share_prefix(const PageTable& donor, std::int64_t pages);
  // The slot of position pos, allocating its page when pos is the first position on it.
  std::int64_t slot_for_write(std::int64_t pos);
  // The slot of an already written position.
  std::int64_t slot(std::int64_t pos) const {
    return pages_[pos / pool_->page_size()] * pool_->page_size() + pos % pool_->page_size();
  }
  std::int64_t page_of(std::int64_t pos) const { return pages_[pos / pool_->page_size()]; }
  std::int64_t page_count() const { return static_cast<std::int64_t>(pages_.size()); }
  std::size_t bytes() const { return pages_.capacity() * sizeof(std::int64_t); }  // measured
  std::int64_t positions_mapped() const { return static_cast<std::int64_t>(pages_.size()) * pool_->page_size(); }
  // Returns logical pages [0, pages) to the pool for good: nothing reads their positions again (a
  // sliding-window layer's pages before every later query's window). Their slots must not be
  // asked for; the table keeps its length, so later positions keep their pages.
  void release_before(std::int64_t pages);
  std::int64_t released() const { return released_; }  // logical pages [0, released()) are released
  void clear();

 private:
  static constexpr std::int64_t kReleased = -1;
  PagePool* pool_;
  std::vector<std::int64_t> pages_;  // [logical page]: its physical page, or kReleased
  std::int64_t released_ = 0;
};

}  // namespace witcert::kvcache
