#include "kvcache/backing_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace witcert::kvcache {
namespace {

std::runtime_error tier_error(const std::string& path, const std::string& what) {
  return std::runtime_error("exact backing tier: '" + path + "' " + what);
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

BackingTier::BackingTier(std::size_t rows, int head_dim, const BackingPlace& place)
    : rows_(rows), d_(static_cast<std::size_t>(head_dim)), place_(place) {
  const std::size_t n = rows_ * d_;
  if (place.ram) {
    ram_ = ReservedArray<f16>(2 * n);
    k_ = ram_.data();
    v_ = k_ + n;
    return;
  }
  if (place.path.empty())
    open_private();
  else
    open_named();
  map();
  k_ = static_cast<f16*>(map_);
  v_ = k_ + n;
}

void BackingTier::open_named() {
  const std::string& path = place_.path;
  const int flags = O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | (place_.overwrite ? 0 : O_EXCL);
  fd_ = ::open(path.c_str(), flags, 0600);
  if (fd_ < 0) {
    if (errno == EEXIST) throw tier_error(path, "exists; choose a new path or pass --backing-file-overwrite");
    if (errno == ELOOP) throw tier_error(path, "is a symbolic link; give the file's own path");
    throw tier_error(path, "cannot be created: " + errno_text());
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    throw tier_error(path, "is not a regular file");
  }
  // One cache per file: a second run naming the same file fails here instead of sharing rows.
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    fd_ = -1;
    throw tier_error(path, "is in use by another run");
  }
  created_ = true;
}

void BackingTier::open_private() {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/witcert-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) throw tier_error(dir, "(a private temporary directory) cannot be made: " + errno_text());
  const std::string path = dir + "/exact-tier";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  const int e = errno;
  if (fd_ >= 0) ::unlink(path.c_str());
  ::rmdir(dir.c_str());
  if (fd_ < 0) {
    errno = e;
    throw tier_error(path, "cannot be created: " + errno_text());
  }
}

void BackingTier::map() {
  const std::string shown = place_.path.empty() ? "(private temporary file)" : place_.path;
  auto fail = [&](const std::string& what) {
    const std::string text = what + ": " + errno_text();
    ::close(fd_);
    fd_ = -1;
    if (created_ && !place_.keep) ::unlink(place_.path.c_str());
    return tier_error(shown, text);
  };
  // Truncating first drops what an overwritten file held; then the file takes the tier's size.
  if (::ftruncate(fd_, 0) != 0 || ::ftruncate(fd_, static_cast<off_t>(bytes())) != 0)
    throw fail("cannot be sized to " + std::to_string(bytes()) + " bytes");
  map_ = ::mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw fail("cannot be mapped");
  }
}

BackingTier::~BackingTier() {
  if (map_) ::munmap(map_, bytes());
  if (created_ && !place_.keep) ::unlink(place_.path.c_str());
  if (fd_ >= 0) ::close(fd_);  // closing releases the lock
}

}  // namespace witcert::kvcache
