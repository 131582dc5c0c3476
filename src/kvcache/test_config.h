// Test support: a CacheConfig from its geometry, format names, page size and page shuffle, and the
// dithered formats (every width) that tests sweep in each dither mode.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/kv_store.h"

namespace witcert::kvcache {

inline CacheConfig test_config(int layers, int kv_heads, int head_dim, std::int64_t capacity, int page_size,
                               const std::string& k_format, const std::string& v_format, std::uint64_t shuffle) {
  CacheConfig c;
  c.layers = layers;
  c.kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.capacity = capacity;
  c.page_size = page_size;
  c.k_format = formats::KvFormat::parse(k_format);
  c.v_format = formats::KvFormat::parse(v_format);
  c.shuffle_pages = shuffle;
  return c;
}

inline bool dithered(const std::string& format) {
  return formats::KvFormat::parse(format).kind() == FormatKind::dither;
}

inline std::vector<std::string> dither_format_names() {
  std::vector<std::string> names;
  for (int bits : formats::kDitherBits) names.emplace_back(formats::KvFormat::dither(bits).name());
  return names;
}

}  // namespace witcert::kvcache
