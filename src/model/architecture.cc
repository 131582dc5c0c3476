#include "model/architecture.h"

#include <stdexcept>

namespace witcert::model {
namespace {

std::vector<Architecture> make_table() {
  std::vector<Architecture> t;
  // Llama 1–3, Mistral and SmolLM: the plain block.
  t.push_back({.name = "llama"});
  t.push_back({.name = "qwen2", .rope_layout = cert::RopeLayout::neox, .qkv_bias = true});
  t.push_back({.name = "qwen3", .rope_layout = cert::RopeLayout::neox, .qk_norm = true});
  t.push_back({.name = "gemma3",
               .mlp = Activation::gelu_tanh,
               .rope_layout = cert::RopeLayout::neox,
               .qk_norm = true,
               .post_norms = true,
               .embed_scale = true,
               .swa_period = 6,
               .swa_rope_theta = 10000.0f});
  return t;
}

const std::vector<Architecture>& table() {
  static const std::vector<Architecture> t = make_table();
  return t;
}

}  // namespace

std::vector<std::string> supported_architectures() {
  std::vector<std::string> names;
  for (const Architecture& a : table()) names.push_back(a.name);
  return names;
}

const Architecture& architecture(const std::string& name) {
  for (const Architecture& a : table())
    if (a.name == name) return a;
  std::string list;
  for (const std::string& n : supported_architectures()) list += (list.empty() ? "" : ", ") + n;
  throw std::runtime_error("model: unsupported architecture '" + name + "' (supported: " + list + ")");
}

}  // namespace witcert::model
