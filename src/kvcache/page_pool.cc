#include "kvcache/page_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>

namespace witcert::kvcache {

void* reserve_zeroed(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw std::runtime_error("cannot reserve " + std::to_string(bytes) + " bytes of address space for the KV pool: " +
                             std::strerror(errno));
  // Where transparent huge pages are always on, one written byte would commit 2 MiB around it;
  // the pool's streams are written a page of tokens (about 1 KiB each) at a time. Best effort: a
  // kernel without THP refuses the advice and commits base pages anyway.
  ::madvise(p, bytes, MADV_NOHUGEPAGE);
  return p;
}

void release_reserved(void* p, std::size_t bytes) {
  if (p != nullptr) ::munmap(p, bytes);
}

PagePool::PagePool(std::int64_t pages, int page_size, std::uint64_t shuffle_seed)
    : pages_(pages), page_size_(page_size) {
  if (pages <= 0) throw std::invalid_argument("a page pool needs at least one page");
  if (page_size <= 0) throw std::invalid_argument("page size must be positive, got " + std::to_string(page_size));
  for (std::int64_t p = pages - 1; p >= 0; --p) free_.push_back(p);
  holders_.assign(static_cast<std::size_t>(pages), 0);
  if (shuffle_seed != 0) std::shuffle(free_.begin(), free_.end(), std::mt19937_64(shuffle_seed));
}

PagePool::PagePool(const PagePool& other) : pages_(other.pages_), page_size_(other.page_size_) {
  const std::lock_guard<std::mutex> lock(other.mu_);
  free_ = other.free_;
  holders_ = other.holders_;
}

std::int64_t PagePool::free_pages() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return static_cast<std::int64_t>(free_.size());
}

std::int64_t PagePool::allocate() {
  const std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty())
    throw PoolExhausted("KV page pool exhausted (" + std::to_string(pages_) + " pages of " +
                             std::to_string(page_size_) + " tokens)");
  const std::int64_t p = free_.back();
  free_.pop_back();
  holders_[static_cast<std::size_t>(p)] = 1;
  return p;
}

void PagePool::share(std::int64_t page) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (page < 0 || page >= pages_ || holders_[static_cast<std::size_t>(page)] == 0)
    throw std::logic_error("sharing page " + std::to_string(page) + ", which no sequence holds");
  ++holders_[static_cast<std::size_t>(page)];
}

int PagePool::holders(std::int64_t page) const {
  const std::lock_guard<std::mutex> lock(mu_);
  return holders_[static_cast<std::size_t>(page)];
}

void PagePool::release(std::int64_t page) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (--holders_[static_cast<std::size_t>(page)] == 0) free_.push_back(page);
}

PageTable::~PageTable() { clear(); }

std::int64_t PageTable::slot_for_write(std::int64_t pos) {
  const std::int64_t logical = pos / pool_->page_size();
  if (logical > static_cast<std::int64_t>(pages_.size()))
    throw std::out_of_range("position " + std::to_string(pos) + " written before the positions ahead of it");
  if (logical == static_cast<std::int64_t>(pages_.size())) pages_.push_back(pool_->allocate());
  return slot(pos);
}

void PageTable::share_prefix(const PageTable& donor, std::int64_t pages) {
  if (donor.pool_ != pool_) throw std::logic_error("sharing pages across pools");
  if (!pages_.empty()) throw std::logic_error("a sequence shares a prefix before it holds any page");
  if (pages < 0 || pages > static_cast<std::int64_t>(donor.pages_.size()))
    throw std::logic_error("sharing " + std::to_string(pages) + " pages of a sequence that holds " +
                           std::to_string(donor.pages_.size()));
  for (std::int64_t i = 0; i < pages; ++i) {
    if (donor.pages_[i] != kReleased) pool_->share(donor.pages_[i]);
    pages_.push_back(donor.pages_[i]);
  }
  released_ = std::min(donor.released_, pages);
}

void PageTable::release_before(std::int64_t pages) {
  pages = std::min(pages, static_cast<std::int64_t>(pages_.size()));
  for (; released_ < pages; ++released_) {
    std::int64_t& p = pages_[static_cast<std::size_t>(released_)];
    if (p != kReleased) pool_->release(p);
    p = kReleased;
  }
}

void PageTable::clear() {
  for (std::int64_t p : pages_)
    if (p != kReleased) pool_->release(p);
  pages_.clear();
  released_ = 0;
}

}  // namespace witcert::kvcache
