// Test support: the real SmolLM2-135M, fetched by scripts/fetch-model.sh (CI fetches it), loaded
// once per test with its tokenizer.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"

namespace witcert::model {

// True in the sanitizer build, where the real model runs ~30x slower: the long real-model sweeps
// run a representative subset there and the whole class in the release build.
#ifdef WITCERT_SANITIZED
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

class RealModelFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = std::string(WITCERT_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    ASSERT_TRUE(std::filesystem::exists(path)) << "the real model is missing: run scripts/fetch-model.sh (" << path << ")";
    file_ = std::make_unique<GgufFile>(GgufFile::open(path));
    model_ = std::make_unique<LlamaModel>(*file_);
    tok_ = std::make_unique<Tokenizer>(Tokenizer::from_gguf(*file_));
  }
  std::unique_ptr<GgufFile> file_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<Tokenizer> tok_;
};

}  // namespace witcert::model
