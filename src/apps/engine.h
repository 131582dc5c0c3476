// What the engine subcommands share: locating and loading the model, and building the prompt.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"

namespace witcert::apps {

inline constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";

// $WITCERT_MODEL if set, else models/<default> beside the build directory of this executable,
// else models/<default> under the current directory.
std::string default_model_path();

struct Engine {
  std::unique_ptr<model::GgufFile> file;
  std::unique_ptr<model::Tokenizer> tokenizer;
  std::unique_ptr<model::LlamaModel> model;

  // Throws std::runtime_error with a clear message when the file is missing or unusable.
  static Engine load(const std::string& path);

  // The prompt's token ids: the text as is, or wrapped as one user turn of the chat template.
  std::vector<std::int32_t> prompt_tokens(const std::string& text, bool chat) const;
  std::vector<std::int32_t> stop_tokens() const;
};

}  // namespace witcert::apps
