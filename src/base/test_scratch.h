// Scratch files of a test process: all in one directory per process (ctest runs tests as
// parallel processes), which is removed with everything in it when the process exits, so that
// repeated test runs leave nothing behind in the temporary directory.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace witcert::testing_util {

inline std::string scratch_path(const std::string& name) {
  static const struct Dir {
    std::filesystem::path path;
    Dir() : path(std::filesystem::path(::testing::TempDir()) / ("witcert_test_" + std::to_string(::getpid()))) {
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      std::error_code ignored;  // nothing to report at exit
      std::filesystem::remove_all(path, ignored);
    }
  } dir;
  return (dir.path / name).string();
}

}  // namespace witcert::testing_util
