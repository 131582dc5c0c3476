#include "engine/model.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>

namespace witcert::engine {

std::string default_model_path() {
  if (const char* env = std::getenv("WITCERT_MODEL"); env && *env) return env;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path beside_build = exe.parent_path().parent_path() / "models" / kDefaultModelFile;
    if (fs::exists(beside_build)) return beside_build.string();
  }
  return (fs::path("models") / kDefaultModelFile).string();
}

Model Model::load(const std::string& path) {
  if (!std::filesystem::exists(path))
    throw std::runtime_error("model file '" + path + "' does not exist (scripts/fetch-model.sh fetches the default one; or name another)");
  Model e;
  e.file = std::make_unique<model::GgufFile>(model::GgufFile::open(path));
  e.tokenizer = std::make_unique<model::Tokenizer>(model::Tokenizer::from_gguf(*e.file));
  e.model = std::make_unique<model::LlamaModel>(*e.file);
  if (e.tokenizer->vocab_size() != e.model->config().vocab)
    throw std::runtime_error("tokenizer vocabulary (" + std::to_string(e.tokenizer->vocab_size()) +
                             ") does not match the model's (" + std::to_string(e.model->config().vocab) + ")");
  return e;
}

std::vector<std::int32_t> Model::prompt_tokens(const std::string& text, bool chat) const {
  if (!chat) {
    std::vector<std::int32_t> ids = tokenizer->encode(text, /*parse_special=*/false);
    return ids.empty() ? ids : tokenizer->with_bos(std::move(ids));  // an empty prompt stays empty
  }
  const model::ChatMessage turn{"user", text};
  return chat_tokens({&turn, 1});
}

std::vector<std::int32_t> Model::chat_tokens(std::span<const model::ChatMessage> messages) const {
  return tokenizer->with_bos(tokenizer->encode_chat(messages, /*add_generation_prompt=*/true));
}

std::vector<std::int32_t> Model::checked_prompt(const std::string& text, bool chat) const {
  std::vector<std::int32_t> prompt = prompt_tokens(text, chat);
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
  if (static_cast<std::int64_t>(prompt.size()) > model->config().context)
    throw std::out_of_range("the prompt has " + std::to_string(prompt.size()) + " tokens, more than the model's context of " +
                            std::to_string(model->config().context));
  return prompt;
}

std::vector<std::int32_t> Model::stop_tokens() const {
  std::vector<std::int32_t> stops;
  for (std::int32_t id = 0; id < tokenizer->vocab_size(); ++id)
    if (tokenizer->is_end_of_generation(id)) stops.push_back(id);
  return stops;
}

}  // namespace witcert::engine
