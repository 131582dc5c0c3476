#include "cache/page_pool.h"

#include <algorithm>
#include <random>
#include <stdexcept>
#include <string>

namespace witcert::cache {

PagePool::PagePool(std::int64_t pages, int page_size, std::uint64_t shuffle_seed)
    : pages_(pages), page_size_(page_size) {
  if (pages <= 0) throw std::invalid_argument("a page pool needs at least one page");
  if (page_size <= 0) throw std::invalid_argument("page size must be positive, got " + std::to_string(page_size));
  for (std::int64_t p = pages - 1; p >= 0; --p) free_.push_back(p);
  if (shuffle_seed != 0) std::shuffle(free_.begin(), free_.end(), std::mt19937_64(shuffle_seed));
}

PagePool::PagePool(const PagePool& other) : pages_(other.pages_), page_size_(other.page_size_) {
  const std::lock_guard<std::mutex> lock(other.mu_);
  free_ = other.free_;
}

std::int64_t PagePool::free_pages() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return static_cast<std::int64_t>(free_.size());
}

std::int64_t PagePool::allocate() {
  const std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty())
    throw std::runtime_error("KV page pool exhausted (" + std::to_string(pages_) + " pages of " +
                             std::to_string(page_size_) + " tokens)");
  const std::int64_t p = free_.back();
  free_.pop_back();
  return p;
}

void PagePool::release(std::int64_t page) {
  const std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(page);
}

PageTable::~PageTable() { clear(); }

std::int64_t PageTable::slot_for_write(std::int64_t pos) {
  const std::int64_t logical = pos / pool_->page_size();
  if (logical > static_cast<std::int64_t>(pages_.size()))
    throw std::out_of_range("position " + std::to_string(pos) + " written before the positions ahead of it");
  if (logical == static_cast<std::int64_t>(pages_.size())) pages_.push_back(pool_->allocate());
  return slot(pos);
}

void PageTable::clear() {
  for (std::int64_t p : pages_) pool_->release(p);
  pages_.clear();
}

}  // namespace witcert::cache
