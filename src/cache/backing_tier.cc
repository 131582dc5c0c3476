#include "cache/backing_tier.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace witcert::cache {

BackingTier::BackingTier(std::size_t rows, int head_dim, const std::string& path)
    : rows_(rows), d_(static_cast<std::size_t>(head_dim)), path_(path) {
  const std::size_t n = rows_ * d_;
  if (path.empty()) {
    ram_.assign(2 * n, 0);
    k_ = ram_.data();
    v_ = k_ + n;
    return;
  }
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd_ < 0) throw std::runtime_error("backing tier: cannot create '" + path + "': " + std::strerror(errno));
  if (::ftruncate(fd_, static_cast<off_t>(bytes())) != 0) {
    const int e = errno;
    ::close(fd_);
    throw std::runtime_error("backing tier: cannot size '" + path + "' to " + std::to_string(bytes()) +
                             " bytes: " + std::strerror(e));
  }
  map_ = ::mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (map_ == MAP_FAILED) {
    const int e = errno;
    map_ = nullptr;
    ::close(fd_);
    throw std::runtime_error("backing tier: cannot map '" + path + "': " + std::strerror(e));
  }
  k_ = static_cast<f16*>(map_);
  v_ = k_ + n;
}

BackingTier::~BackingTier() {
  if (map_) ::munmap(map_, bytes());
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace witcert::cache
