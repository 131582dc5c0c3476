// One KV-cache format, parsed once where the user names it: fp16 (exact), dither-int8 (Tier B) or a
// registered black-box scheme (Tier A, formats/schemes.h). Below the command line and the JSON
// nothing compares format names; the cache and the kernel switch on kind().
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "formats/schemes.h"

namespace witcert::formats {

enum class FormatKind { exact, scheme, dither_int8 };

inline constexpr const char* kFp16 = "fp16";
inline constexpr const char* kDitherInt8 = "dither-int8";

class KvFormat {
 public:
  KvFormat() = default;  // fp16
  static KvFormat dither_int8() { return KvFormat(FormatKind::dither_int8, nullptr, nullptr); }
  // Throws std::invalid_argument listing every format for an unknown name.
  static KvFormat parse(std::string_view name);

  FormatKind kind() const { return kind_; }
  // The scheme that stores this side (KIVI and KVQuant quantize keys per channel and values per
  // token); nullptr unless FormatKind::scheme.
  const KvScheme* scheme(KvSide side) const { return side == KvSide::key ? key_ : value_; }
  std::string_view name() const;
  bool operator==(const KvFormat&) const = default;

 private:
  KvFormat(FormatKind kind, const KvScheme* key, const KvScheme* value) : kind_(kind), key_(key), value_(value) {}
  FormatKind kind_ = FormatKind::exact;
  const KvScheme* key_ = nullptr;
  const KvScheme* value_ = nullptr;
};

// Every format: the registered schemes (fp16 first) and dither-int8.
std::vector<std::string> kv_format_names();

}  // namespace witcert::formats
