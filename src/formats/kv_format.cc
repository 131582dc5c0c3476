#include "formats/kv_format.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>

#include "formats/external/external.h"

namespace witcert::formats {

namespace {
constexpr const char* kDitherNames[] = {"dither-int4", "dither-int5", "dither-int6", "dither-int8"};
static_assert(std::size(kDitherNames) == std::size(kDitherBits));
}  // namespace

KvFormat KvFormat::dither(int bits) {
  for (int b : kDitherBits)
    if (b == bits) return KvFormat(FormatKind::dither, nullptr, nullptr, bits);
  throw std::invalid_argument("dithered codes take 4, 5, 6 or 8 bits, got " + std::to_string(bits));
}

KvFormat KvFormat::parse(std::string_view name) {
  if (name == kFp16) return KvFormat();
  for (std::size_t i = 0; i < std::size(kDitherBits); ++i)
    if (name == kDitherNames[i]) return dither(kDitherBits[i]);
  for (const std::string& s : kv_scheme_names())
    if (s == name) return KvFormat(FormatKind::scheme, &kv_scheme(s, KvSide::key), &kv_scheme(s, KvSide::value));
  std::string known;
  for (const std::string& s : kv_format_names()) known += (known.empty() ? "" : ", ") + s;
  throw std::invalid_argument("unknown KV-cache format '" + std::string(name) + "'; known: " + known);
}

KvFormat KvFormat::external() {
  return KvFormat(FormatKind::scheme, &external_scheme(KvSide::key), &external_scheme(KvSide::value));
}

std::string_view KvFormat::name() const {
  switch (kind_) {
    case FormatKind::exact: return kFp16;
    case FormatKind::dither:
      for (std::size_t i = 0; i < std::size(kDitherBits); ++i)
        if (kDitherBits[i] == bits_) return kDitherNames[i];
      break;
    case FormatKind::scheme: break;
  }
  return key_->name();
}

std::vector<std::string> kv_format_names() {
  std::vector<std::string> names = kv_scheme_names();  // fp16 among them, as Tier A's exact scheme
  if (std::find(names.begin(), names.end(), kFp16) == names.end()) names.insert(names.begin(), kFp16);
  names.insert(names.end(), std::begin(kDitherNames), std::end(kDitherNames));
  return names;
}

}  // namespace witcert::formats
