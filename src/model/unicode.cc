#include "model/unicode.h"

#include <algorithm>
#include <array>
#include <iterator>

namespace witcert::model {
namespace {

struct CodepointRange {
  char32_t lo, hi;
  CharClass cls;
};

constexpr CharClass kLetter = CharClass::letter;
constexpr CharClass kNumber = CharClass::number;
constexpr CharClass kSpace = CharClass::space;

constexpr CodepointRange kRanges[] = {
#include "model/unicode_tables.inc"
};

// ASCII dominates real text; a direct table keeps it off the binary search.
constexpr std::array<CharClass, 128> kAscii = [] {
  std::array<CharClass, 128> t{};
  for (const CodepointRange& r : kRanges)
    for (char32_t cp = r.lo; cp <= r.hi && cp < 128; ++cp) t[cp] = r.cls;
  return t;
}();

}  // namespace

CharClass char_class(char32_t cp) {
  if (cp < 128) return kAscii[cp];
  const auto* it = std::upper_bound(std::begin(kRanges), std::end(kRanges), cp,
                                    [](char32_t c, const CodepointRange& r) { return c < r.lo; });
  if (it == std::begin(kRanges)) return CharClass::other;
  --it;
  return cp <= it->hi ? it->cls : CharClass::other;
}

Utf8Char utf8_decode(std::string_view text, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return {b0, 1};
  int len;
  char32_t cp;
  char32_t min;  // smallest code point of this length: anything below is an overlong form
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, cp = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, cp = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return {kInvalidUtf8, 1};
  }
  if (i + len > text.size()) return {kInvalidUtf8, 1};
  for (int k = 1; k < len; ++k) {
    const unsigned char b = byte(i + k);
    if ((b & 0xC0) != 0x80) return {kInvalidUtf8, 1};
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {kInvalidUtf8, 1};
  return {cp, len};
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace witcert::model
