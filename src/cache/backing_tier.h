// The exact backing tier (paper §6.3.10): the fp16 keys and values the model produced, written
// on every cache write and read by repair. It lives in RAM, or in a memory-mapped file for the
// CPU case, where RAM is exactly what the quantized cache is meant to save.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "base/fp16.h"

namespace witcert::cache {

class BackingTier {
 public:
  // rows × head_dim fp16 values for K and for V; path "" keeps them in RAM, otherwise in a file
  // created (or truncated) at path and mapped shared. Throws std::runtime_error on I/O failure.
  BackingTier(std::size_t rows, int head_dim, const std::string& path = "");
  ~BackingTier();
  BackingTier(const BackingTier&) = delete;
  BackingTier& operator=(const BackingTier&) = delete;

  f16* key_row(std::size_t row) { return k_ + row * d_; }
  f16* value_row(std::size_t row) { return v_ + row * d_; }
  const f16* key_row(std::size_t row) const { return k_ + row * d_; }
  const f16* value_row(std::size_t row) const { return v_ + row * d_; }

  std::size_t bytes() const { return 2 * rows_ * d_ * sizeof(f16); }
  bool file_backed() const { return map_ != nullptr; }
  const std::string& path() const { return path_; }

 private:
  std::size_t rows_;
  std::size_t d_;
  std::string path_;
  std::vector<f16> ram_;
  void* map_ = nullptr;
  int fd_ = -1;
  f16* k_ = nullptr;
  f16* v_ = nullptr;
};

}  // namespace witcert::cache
