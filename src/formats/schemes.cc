#include "formats/schemes.h"

#include <stdexcept>
#include <string>

#include "formats/scheme_kit.h"

namespace witcert::formats {

void KvScheme::check_head_dim(int head_dim) const {
  kit::require(head_dim > 0, name(), "head_dim must be positive", head_dim);
}

double KvScheme::bytes_per_token(int head_dim) const {
  return static_cast<double>(block_bytes(head_dim)) / tokens_per_block();
}

namespace {

const std::vector<kit::SchemeEntry>& registry() {
  static const std::vector<kit::SchemeEntry> entries = [] {
    std::vector<kit::SchemeEntry> all;
    for (auto part : {kit::fp16_schemes(), kit::fp8_schemes(), kit::rtn_schemes(), kit::sign_schemes(),
                      kit::rotation_schemes(), kit::group_schemes(), kit::ggml_schemes()})
      all.insert(all.end(), part.begin(), part.end());
    return all;
  }();
  return entries;
}

}  // namespace

const KvScheme& kv_scheme(std::string_view name, KvSide side) {
  for (const kit::SchemeEntry& e : registry())
    if (e.name == name) return side == KvSide::key ? *e.key : *e.value;
  std::string known;
  for (const kit::SchemeEntry& e : registry()) known += (known.empty() ? "" : ", ") + std::string(e.name);
  throw std::invalid_argument("unknown KV scheme '" + std::string(name) + "'; known: " + known);
}

std::vector<std::string> kv_scheme_names() {
  std::vector<std::string> names;
  for (const kit::SchemeEntry& e : registry()) names.emplace_back(e.name);
  return names;
}

}  // namespace witcert::formats
