#include "formats/kv_format.h"

#include <algorithm>
#include <stdexcept>

namespace witcert::formats {

KvFormat KvFormat::parse(std::string_view name) {
  if (name == kFp16) return KvFormat();
  if (name == kDitherInt8) return dither_int8();
  for (const std::string& s : kv_scheme_names())
    if (s == name) return KvFormat(FormatKind::scheme, &kv_scheme(s, KvSide::key), &kv_scheme(s, KvSide::value));
  std::string known;
  for (const std::string& s : kv_format_names()) known += (known.empty() ? "" : ", ") + s;
  throw std::invalid_argument("unknown KV-cache format '" + std::string(name) + "'; known: " + known);
}

std::string_view KvFormat::name() const {
  switch (kind_) {
    case FormatKind::exact: return kFp16;
    case FormatKind::dither_int8: return kDitherInt8;
    case FormatKind::scheme: break;
  }
  return key_->name();
}

std::vector<std::string> kv_format_names() {
  std::vector<std::string> names = kv_scheme_names();  // fp16 among them, as Tier A's exact scheme
  if (std::find(names.begin(), names.end(), kFp16) == names.end()) names.insert(names.begin(), kFp16);
  names.push_back(kDitherInt8);
  return names;
}

}  // namespace witcert::formats
