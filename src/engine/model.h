// The loaded model: its GGUF file, tokenizer and forward pass, found and checked once, and the
// prompt built from text.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"

namespace witcert::engine {

inline constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";

// $WITCERT_MODEL if set, else models/<default> beside the build directory of this executable,
// else models/<default> under the current directory.
std::string default_model_path();

struct Model {
  std::unique_ptr<model::GgufFile> file;
  std::unique_ptr<model::Tokenizer> tokenizer;
  std::unique_ptr<model::LlamaModel> model;

  // Throws std::runtime_error with a clear message when the file is missing or unusable.
  static Model load(const std::string& path);

  // The prompt's token ids: the text as is, or wrapped as one user turn of the chat template; either
  // way control-token text in it stays text (Tokenizer::encode_chat). Begins with bos when the
  // model asks for it (tokenizer.ggml.add_bos_token), as llama.cpp does; an empty text stays empty.
  std::vector<std::int32_t> prompt_tokens(const std::string& text, bool chat) const;
  // The chat template's tokens for these messages, with bos as prompt_tokens.
  std::vector<std::int32_t> chat_tokens(std::span<const model::ChatMessage> messages) const;
  // prompt_tokens, refusing an empty prompt (std::invalid_argument) and one beyond the model's
  // context (std::out_of_range).
  std::vector<std::int32_t> checked_prompt(const std::string& text, bool chat) const;
  std::vector<std::int32_t> stop_tokens() const;
};

}  // namespace witcert::engine
