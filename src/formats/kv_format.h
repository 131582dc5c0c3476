// One KV-cache format, parsed once where the user names it: fp16 (exact), dither-int4/5/6/8 (Tier B) or
// a registered black-box scheme (Tier A, formats/schemes.h). Below the command line and the JSON
// nothing compares format names; the cache and the kernel switch on kind().
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "formats/dither/dither.h"
#include "formats/schemes.h"

namespace witcert::formats {

enum class FormatKind { exact, scheme, dither };

inline constexpr const char* kFp16 = "fp16";
inline constexpr const char* kDitherInt8 = "dither-int8";

class KvFormat {
 public:
  KvFormat() = default;  // fp16
  // Subtractively dithered codes of `bits` ∈ kDitherBits; throws std::invalid_argument otherwise.
  static KvFormat dither(int bits = 8);
  // Throws std::invalid_argument listing every format for an unknown name.
  static KvFormat parse(std::string_view name);
  // The caller's own reconstructions (formats/external): not a name parse() takes.
  static KvFormat external();

  FormatKind kind() const { return kind_; }
  // The scheme that stores this side (KIVI and KVQuant quantize keys per channel and values per
  // token); nullptr unless FormatKind::scheme.
  const KvScheme* scheme(KvSide side) const { return side == KvSide::key ? key_ : value_; }
  std::string_view name() const;
  int dither_bits() const { return bits_; }  // FormatKind::dither: B; otherwise 0
  bool operator==(const KvFormat&) const = default;

 private:
  KvFormat(FormatKind kind, const KvScheme* key, const KvScheme* value, int bits = 0)
      : kind_(kind), key_(key), value_(value), bits_(bits) {}
  FormatKind kind_ = FormatKind::exact;
  const KvScheme* key_ = nullptr;
  const KvScheme* value_ = nullptr;
  int bits_ = 0;
};

// Every format: the registered schemes (fp16 first) and the dithered formats.
std::vector<std::string> kv_format_names();

}  // namespace witcert::formats
