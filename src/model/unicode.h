// The few Unicode facts a byte-level BPE pre-tokenizer needs: UTF-8 decoding that never fails
// and the classes \p{L}, \p{N} and \s of the GPT-2 split regex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace witcert::model {

enum class CharClass : std::uint8_t { other, letter, number, space };

// Class of a code point (Unicode general categories L* and N*, property White_Space).
CharClass char_class(char32_t cp);

// A decoded character: its code point and its length in bytes.
struct Utf8Char {
  char32_t cp;
  int len;
};

// Code point value standing for a byte that does not start a well-formed UTF-8 sequence.
inline constexpr char32_t kInvalidUtf8 = 0xFFFFFFFF;

// Decodes the character starting at text[i] (i < text.size()). A byte that does not start a
// well-formed sequence (stray continuation, overlong form, surrogate, beyond U+10FFFF,
// truncated) decodes as {kInvalidUtf8, 1}, so every byte of the input belongs to exactly one
// character and no input is rejected.
Utf8Char utf8_decode(std::string_view text, std::size_t i);

void utf8_append(std::string& out, char32_t cp);

}  // namespace witcert::model
