// The exact backing tier (paper §6.3.10): the fp16 keys and values the model produced, written
// on every cache write and read by repair and by the soundness check. It lives in RAM, or in a
// memory-mapped file for the CPU case, where RAM is exactly what the quantized cache is meant to
// save.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "base/fp16.h"
#include "kvcache/page_pool.h"

namespace witcert::kvcache {

// Where the tier lives. A named file is created new (O_CREAT | O_EXCL, never through a symbolic
// link) unless overwrite is set, is locked against a second cache for as long as this one lives,
// and is removed when the tier is destroyed unless keep is set. With no name the file is created
// in a private temporary directory and unlinked at once: nothing is left behind, even on a crash.
struct BackingPlace {
  bool ram = false;
  std::string path;
  bool overwrite = false;
  bool keep = false;

  static BackingPlace in_ram() { return {true, "", false, false}; }
  static BackingPlace file(std::string path, bool overwrite = false, bool keep = false) {
    return {false, std::move(path), overwrite, keep};
  }
};

class BackingTier {
 public:
  // rows × head_dim fp16 values for K and for V. Throws std::runtime_error on I/O failure or a
  // file that may not be used (exists without overwrite, held by another cache, not a regular
  // file), naming the path.
  BackingTier(std::size_t rows, int head_dim, const BackingPlace& place = BackingPlace::in_ram());
  ~BackingTier();
  BackingTier(const BackingTier&) = delete;
  BackingTier& operator=(const BackingTier&) = delete;

  f16* key_row(std::size_t row) { return k_ + row * d_; }
  f16* value_row(std::size_t row) { return v_ + row * d_; }
  const f16* key_row(std::size_t row) const { return k_ + row * d_; }
  const f16* value_row(std::size_t row) const { return v_ + row * d_; }

  std::size_t bytes() const { return 2 * rows_ * d_ * sizeof(f16); }
  bool file_backed() const { return map_ != nullptr; }
  const std::string& path() const { return place_.path; }  // "" for RAM and for a private file

 private:
  void open_named();
  void open_private();
  void map();

  std::size_t rows_;
  std::size_t d_;
  BackingPlace place_;
  ReservedArray<f16> ram_;  // committed as rows are written
  void* map_ = nullptr;
  int fd_ = -1;
  bool created_ = false;  // this tier made or took over the named file: it removes it unless keep
  f16* k_ = nullptr;
  f16* v_ = nullptr;
};

}  // namespace witcert::kvcache
