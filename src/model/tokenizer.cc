#include "model/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "model/gguf.h"
#include "model/unicode.h"

namespace witcert::model {
namespace {

// GPT-2's byte alphabet: the printable Latin-1 bytes stand for themselves and the other 68
// are shifted, in order, to U+0100..U+0143, so that every token string is printable text.
constexpr bool printable_latin1(unsigned b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

constexpr char32_t kByteAlphabetEnd = 0x144;

constexpr std::array<char32_t, 256> kByteToCp = [] {
  std::array<char32_t, 256> t{};
  char32_t shifted = 0x100;
  for (unsigned b = 0; b < 256; ++b) t[b] = printable_latin1(b) ? b : shifted++;
  return t;
}();

constexpr std::array<std::int16_t, kByteAlphabetEnd> kCpToByte = [] {
  std::array<std::int16_t, kByteAlphabetEnd> t{};
  t.fill(-1);
  for (unsigned b = 0; b < 256; ++b) t[kByteToCp[b]] = static_cast<std::int16_t>(b);
  return t;
}();

// The bytes a normal token stands for. A token with a character outside the byte alphabet
// stands for its own text, as in the reference ByteLevel decoder.
std::string byte_level_piece(const std::string& token) {
  std::string bytes;
  for (std::size_t i = 0; i < token.size();) {
    const Utf8Char c = utf8_decode(token, i);
    if (c.cp >= kByteAlphabetEnd || kCpToByte[c.cp] < 0) return token;
    bytes += static_cast<char>(kCpToByte[c.cp]);
    i += c.len;
  }
  return bytes;
}

// Pre-tokenizer names that split every digit off before the GPT-2 regex (llama.cpp groups
// them so). Any other name gets the GPT-2 regex alone: it is the base every byte-level BPE
// variant refines, and a mismatch there costs tokenization quality, never the round trip.
constexpr std::string_view kDigitSplitPre[] = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"};
// Pre-tokenizer names of Llama 3's regex (numbers in runs of up to three digits; a whole pre-token
// that is a token is taken as it is) and of Qwen 2's (the same with single digits), as llama.cpp
// groups them.
constexpr std::string_view kLlama3Pre[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "pixtral"};
constexpr std::string_view kQwen2Pre[] = {"qwen2", "deepseek-r1-qwen", "megrez"};

// Texts of the tokens that end a turn in chat models, besides eos.
constexpr std::string_view kEndOfTurnTexts[] = {"<|im_end|>", "<|endoftext|>", "<end_of_turn>"};

constexpr std::string_view kStartOfTurn = "<start_of_turn>";
constexpr std::string_view kEndOfTurn = "<end_of_turn>";
constexpr std::string_view kSpmSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// A SentencePiece token's bytes: U+2581 as a space.
std::string spm_piece(std::string_view token) {
  std::string out;
  for (std::size_t i = 0; i < token.size();) {
    if (token.substr(i).starts_with(kSpmSpace)) {
      out += ' ';
      i += kSpmSpace.size();
    } else {
      out += token[i++];
    }
  }
  return out;
}

// The byte a SentencePiece byte token "<0xXX>" stands for, or -1.
int spm_byte(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return -1;
  int v = 0;
  for (char ch : token.substr(3, 2)) {
    const int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

// Bytes of the UTF-8 sequence a lead byte announces (1 for a continuation or invalid byte), as
// llama.cpp's unicode_len_utf8.
std::size_t utf8_len(unsigned char lead) {
  static constexpr std::size_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[lead >> 4];
}

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";

std::uint64_t pair_key(std::int32_t left, std::int32_t right) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32) | static_cast<std::uint32_t>(right);
}

// The interior of a Jinja string literal, unescaped; nullopt if `s` is not one (a quote ends
// the literal, braces open an expression).
std::optional<std::string> jinja_literal(std::string_view s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char ch = s[i];
    if (ch == '\\' && i + 1 < s.size()) {
      const char e = s[++i];
      out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
    } else if (ch == '\'' || ch == '"' || ch == '{' || ch == '}') {
      return std::nullopt;
    } else {
      out += ch;
    }
  }
  return out;
}

// The system message a ChatML template writes itself when the conversation has none: the first
// "<|im_start|>system" followed by a newline and literal text up to "<|im_end|>".
std::optional<std::string> default_system_message(std::string_view tmpl) {
  const std::string_view head = "<|im_start|>system";
  for (std::size_t at = tmpl.find(head); at != std::string_view::npos; at = tmpl.find(head, at + 1)) {
    std::string_view rest = tmpl.substr(at + head.size());
    if (rest.starts_with("\n")) {
      rest.remove_prefix(1);
    } else if (rest.starts_with("\\n")) {
      rest.remove_prefix(2);
    } else {
      continue;
    }
    const std::size_t end = rest.find(kImEnd);
    if (end == std::string_view::npos) continue;
    if (auto text = jinja_literal(rest.substr(0, end))) return text;
  }
  return std::nullopt;
}

std::string template_excerpt(const std::string& tmpl) {
  constexpr std::size_t kMax = 80;
  return tmpl.size() <= kMax ? tmpl : tmpl.substr(0, kMax) + "...";
}

}  // namespace

// Buffers reused across the words of one encode call.
struct Tokenizer::Scratch {
  struct Char {
    std::uint32_t offset;
    char32_t cp;
    CharClass cls;
  };
  struct Symbol {
    std::int32_t id, prev, next;  // id -1: merged into its left neighbour
  };
  struct Candidate {
    std::int32_t rank, left, left_id, right_id, result;
    // Lowest rank first, then leftmost: the order the reference BPE applies merges in.
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::vector<Char> chars;
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
};

Tokenizer Tokenizer::from_vocab(Vocab vocab) {
  const std::size_t n = vocab.tokens.size();
  if (n == 0) throw TokenizerError("vocabulary has no tokens");
  if (n > static_cast<std::size_t>(INT32_MAX)) throw TokenizerError("vocabulary too large");
  if (!vocab.token_types.empty() && vocab.token_types.size() != n)
    throw TokenizerError("vocabulary has " + std::to_string(n) + " tokens but " +
                         std::to_string(vocab.token_types.size()) + " token types");
  const auto check_id = [&](const char* name, std::int32_t id) {
    if (id < -1 || id >= static_cast<std::int32_t>(n))
      throw TokenizerError(std::string(name) + " token id " + std::to_string(id) + " outside the vocabulary of " +
                           std::to_string(n) + " tokens");
  };
  check_id("bos", vocab.bos);
  check_id("eos", vocab.eos);
  check_id("unk", vocab.unk);
  check_id("pad", vocab.pad);

  if (vocab.model != "gpt2" && vocab.model != "llama")
    throw TokenizerError("unsupported tokenizer model '" + vocab.model + "' (supported: gpt2, llama)");
  const bool spm = vocab.model == "llama";
  if (spm && vocab.scores.size() != n)
    throw TokenizerError("SentencePiece vocabulary has " + std::to_string(n) + " tokens but " +
                         std::to_string(vocab.scores.size()) + " scores");
  Tokenizer t;
  t.spm_ = spm;
  t.add_space_prefix_ = spm && vocab.add_space_prefix;
  if (spm) t.scores_ = std::move(vocab.scores);
  t.bos_ = vocab.bos;
  t.eos_ = vocab.eos;
  t.add_bos_ = vocab.add_bos;
  t.split_digits_ = std::ranges::find(kDigitSplitPre, vocab.pre) != std::end(kDigitSplitPre);
  if (std::ranges::find(kLlama3Pre, vocab.pre) != std::end(kLlama3Pre)) t.pre_ = PreTokenizer::llama3;
  if (std::ranges::find(kQwen2Pre, vocab.pre) != std::end(kQwen2Pre)) t.pre_ = PreTokenizer::qwen2;

  // Token text -> id; a text listed twice keeps its first id.
  std::unordered_map<std::string_view, std::int32_t> id_of;
  id_of.reserve(n);
  t.pieces_.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::string& text = vocab.tokens[i];
    const auto id = static_cast<std::int32_t>(i);
    id_of.emplace(text, id);
    const auto type = vocab.token_types.empty() ? TokenType::normal : static_cast<TokenType>(vocab.token_types[i]);
    const bool special = type == TokenType::control || type == TokenType::user_defined;
    if (!spm) {
      t.pieces_.push_back(special ? text : byte_level_piece(text));
      if (t.pre_ == PreTokenizer::llama3 && !special) t.whole_ids_.emplace(t.pieces_.back(), id);
    } else if (const int byte = spm_byte(text); type == TokenType::byte && byte >= 0) {
      t.pieces_.push_back(std::string(1, static_cast<char>(byte)));
    } else {
      t.pieces_.push_back(special ? text : spm_piece(text));
    }
    if (spm) t.whole_ids_.emplace(text, id);
    const bool end_of_turn = std::ranges::find(kEndOfTurnTexts, text) != std::end(kEndOfTurnTexts);
    // A chat marker is a control token even where the file calls it user-defined: text never forges one.
    if (special && !text.empty())
      t.specials_.push_back({text, id, type == TokenType::control || end_of_turn || text == kImStart || text == kStartOfTurn});
    if (end_of_turn) t.end_of_generation_.push_back(id);
  }
  if (t.eos_ >= 0) t.end_of_generation_.push_back(t.eos_);
  // Longest first, so that at one position the longest special token wins.
  std::ranges::stable_sort(t.specials_, [](const Special& a, const Special& b) { return a.text.size() > b.text.size(); });
  for (const Special& s : t.specials_) t.special_first_byte_[static_cast<unsigned char>(s.text[0])] = true;

  for (unsigned b = 0; b < 256; ++b) {
    std::string symbol;
    if (spm) {  // its byte token, else a token of the byte itself
      static const char* hex = "0123456789ABCDEF";
      symbol = std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
      if (!id_of.contains(symbol)) symbol = std::string(1, static_cast<char>(b));
    } else {
      utf8_append(symbol, kByteToCp[b]);
    }
    const auto it = id_of.find(symbol);
    if (it != id_of.end()) {
      t.byte_token_[b] = it->second;
    } else if (vocab.unk >= 0) {
      t.byte_token_[b] = vocab.unk;
    } else {
      throw TokenizerError("byte " + std::to_string(b) + " has no token ('" + symbol +
                           "') and the vocabulary has no unknown token");
    }
  }

  t.merges_.reserve(vocab.merges.size());
  for (std::size_t r = 0; r < vocab.merges.size(); ++r) {
    const std::string& m = vocab.merges[r];
    const std::size_t space = m.find(' ');
    const auto bad = [&](const std::string& why) {
      return TokenizerError("merge " + std::to_string(r) + " '" + m + "' " + why);
    };
    if (space == std::string::npos || space == 0 || space + 1 == m.size() || m.find(' ', space + 1) != std::string::npos)
      throw bad("is not two tokens separated by one space");
    const std::string_view left = std::string_view(m).substr(0, space);
    const std::string_view right = std::string_view(m).substr(space + 1);
    const auto l = id_of.find(left), rt = id_of.find(right);
    const auto merged = id_of.find(std::string(left) + std::string(right));
    if (l == id_of.end() || rt == id_of.end() || merged == id_of.end()) throw bad("names a token not in the vocabulary");
    t.merges_.emplace(pair_key(l->second, rt->second), Merge{static_cast<std::int32_t>(r), merged->second});
  }

  t.chat_template_ = std::move(vocab.chat_template);
  // The family the template names; without a template, the one whose markers are tokens.
  const auto names = [&](std::string_view marker) {
    return t.chat_template_.empty() ? id_of.contains(marker) : t.chat_template_.find(marker) != std::string::npos;
  };
  if (names(kImStart)) {
    t.chat_family_ = ChatFamily::chatml;
    t.default_system_ = default_system_message(t.chat_template_);
  } else if (names(kStartOfTurn) && id_of.contains(kEndOfTurn)) {
    t.chat_family_ = ChatFamily::gemma;
  }
  return t;
}

Tokenizer Tokenizer::from_gguf(const GgufFile& file) {
  const std::string model = file.get_string_or("tokenizer.ggml.model", "");
  if (model.empty()) throw TokenizerError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)");
  if (model != "gpt2" && model != "llama")
    throw TokenizerError("unsupported tokenizer model '" + model +
                         "' (supported: gpt2, byte-level BPE; llama, SentencePiece)");
  Vocab v;
  v.model = model;
  if (model == "gpt2") {
    if (!file.find("tokenizer.ggml.merges")) throw TokenizerError("byte-level BPE tokenizer without tokenizer.ggml.merges");
    v.merges = file.get_string_array("tokenizer.ggml.merges");
  } else {
    if (!file.find("tokenizer.ggml.scores")) throw TokenizerError("SentencePiece tokenizer without tokenizer.ggml.scores");
    for (double score : file.get_f64_array("tokenizer.ggml.scores")) v.scores.push_back(static_cast<float>(score));
    v.add_space_prefix = file.get_bool_or("tokenizer.ggml.add_space_prefix", true);
  }
  v.tokens = file.get_string_array("tokenizer.ggml.tokens");
  if (file.find("tokenizer.ggml.token_type"))
    for (std::int64_t type : file.get_int_array("tokenizer.ggml.token_type")) v.token_types.push_back(static_cast<std::int32_t>(type));
  const auto id = [&](const char* key) {
    if (!file.find(key)) return std::int32_t{-1};
    const std::int64_t value = file.get_i64(key);
    if (value < 0 || value > INT32_MAX) throw TokenizerError(std::string(key) + " = " + std::to_string(value) + " is not a token id");
    return static_cast<std::int32_t>(value);
  };
  v.bos = id("tokenizer.ggml.bos_token_id");
  v.eos = id("tokenizer.ggml.eos_token_id");
  v.unk = id("tokenizer.ggml.unknown_token_id");
  v.pad = id("tokenizer.ggml.padding_token_id");
  v.pre = file.get_string_or("tokenizer.ggml.pre", "");
  v.add_bos = file.get_bool_or("tokenizer.ggml.add_bos_token", false);
  v.chat_template = file.get_string_or("tokenizer.chat_template", "");
  return from_vocab(std::move(v));
}

const Tokenizer::Merge* Tokenizer::find_merge(std::int32_t left, std::int32_t right) const {
  const auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<std::int32_t> out;
  out.reserve(text.size() / 3 + 1);
  Scratch s;
  // SentencePiece writes a space before text at the start or after a special token, when the
  // model asks for it.
  bool after_special = true;
  const auto encode_text = [&](std::string_view fragment) {
    if (fragment.empty()) return;
    if (!spm_) return encode_fragment(fragment, s, out);
    std::string escaped = add_space_prefix_ && after_special ? std::string(kSpmSpace) : std::string();
    for (char ch : fragment) {
      if (ch == ' ') {
        escaped += kSpmSpace;
      } else {
        escaped += ch;
      }
    }
    after_special = false;
    encode_spm(escaped, out);
  };
  // Cut special tokens out first (leftmost, then longest), as the reference tokenizers do.
  std::size_t start = 0;
  for (std::size_t i = 0; i < text.size();) {
    const Special* hit = nullptr;
    if (special_first_byte_[static_cast<unsigned char>(text[i])]) {
      for (const Special& sp : specials_) {
        if ((!sp.control || parse_special) && text.substr(i).starts_with(sp.text)) {
          hit = &sp;
          break;
        }
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    encode_text(text.substr(start, i - start));
    out.push_back(hit->id);
    i += hit->text.size();
    start = i;
    after_special = true;
  }
  encode_text(text.substr(start));
  return out;
}

// Pre-tokenization: with split_digits_, every \p{N} character stands alone; each remaining
// segment is split by the GPT-2 regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// with the end of a segment acting as the end of the text. Bytes outside well-formed UTF-8
// count as [^\s\p{L}\p{N}].
void Tokenizer::encode_fragment(std::string_view text, Scratch& s, std::vector<std::int32_t>& out) const {
  if (text.empty()) return;
  s.chars.clear();
  for (std::size_t i = 0; i < text.size();) {
    const Utf8Char c = utf8_decode(text, i);
    const CharClass cls = c.cp == kInvalidUtf8 ? CharClass::other : char_class(c.cp);
    s.chars.push_back({static_cast<std::uint32_t>(i), c.cp, cls});
    i += c.len;
  }
  const std::size_t n = s.chars.size();
  s.chars.push_back({static_cast<std::uint32_t>(text.size()), 0, CharClass::other});  // end offset
  const auto& c = s.chars;

  // One regex match starting at i, within [i, end).
  const auto match = [&](std::size_t i, std::size_t end) {
    if (c[i].cp == '\'' && i + 1 < end) {
      const char32_t a = c[i + 1].cp;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
      if (i + 2 < end) {
        const char32_t b = c[i + 2].cp;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
      }
    }
    const std::size_t k = c[i].cp == ' ' && i + 1 < end && c[i + 1].cls != CharClass::space ? i + 1 : i;
    std::size_t j = k + 1;
    if (c[k].cls != CharClass::space) {  // ` ?\p{L}+`, ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`
      while (j < end && c[j].cls == c[k].cls) ++j;
      return j;
    }
    while (j < end && c[j].cls == CharClass::space) ++j;
    // `\s+(?!\S)` leaves the last blank of a run to the word after it; `\s+` takes a lone one.
    return j == end || j - i == 1 ? j : j - 1;
  };

  // Llama 3's and Qwen 2's regex, one match starting at i:
  //   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  //   \s*[\r\n]+|\s+(?!\S)|\s+      (Qwen 2: \p{N} alone)
  const auto newline = [&](std::size_t k) { return c[k].cp == '\r' || c[k].cp == '\n'; };
  const auto lower = [&](std::size_t k) { return c[k].cp < 128 ? static_cast<char32_t>(std::tolower(static_cast<int>(c[k].cp))) : c[k].cp; };
  const auto match_llama3 = [&](std::size_t i) -> std::size_t {
    if (c[i].cp == '\'' && i + 1 < n) {
      const char32_t a = lower(i + 1);
      if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
      if (i + 2 < n) {
        const char32_t b = lower(i + 2);
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
      }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    std::size_t k = i;
    if (c[k].cls != CharClass::letter && c[k].cls != CharClass::number && !newline(k) && k + 1 < n &&
        c[k + 1].cls == CharClass::letter)
      ++k;
    if (c[k].cls == CharClass::letter) {
      while (k < n && c[k].cls == CharClass::letter) ++k;
      return k;
    }
    if (c[i].cls == CharClass::number) {  // \p{N}{1,3} or \p{N}
      const std::size_t most = pre_ == PreTokenizer::llama3 ? 3 : 1;
      std::size_t j = i;
      while (j < n && j - i < most && c[j].cls == CharClass::number) ++j;
      return j;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    k = c[i].cp == ' ' && i + 1 < n && c[i + 1].cls == CharClass::other ? i + 1 : i;
    if (c[k].cls == CharClass::other) {
      while (k < n && c[k].cls == CharClass::other) ++k;
      while (k < n && newline(k)) ++k;
      return k;
    }
    // The blank run from i: \s*[\r\n]+ ends after its last newline; else \s+(?!\S) leaves its
    // last blank to the word after it, and \s+ takes a lone one.
    std::size_t j = i;
    std::size_t after_newline = i;
    while (j < n && c[j].cls == CharClass::space) {
      if (newline(j)) after_newline = j + 1;
      ++j;
    }
    if (after_newline > i) return after_newline;
    return j == n || j - i == 1 ? j : j - 1;
  };
  if (pre_ != PreTokenizer::gpt2) {
    for (std::size_t i = 0; i < n;) {
      const std::size_t j = match_llama3(i);
      encode_word(text.substr(c[i].offset, c[j].offset - c[i].offset), s, out);
      i = j;
    }
    return;
  }

  for (std::size_t seg = 0; seg < n;) {
    std::size_t seg_end = n;
    if (split_digits_) {
      seg_end = seg + 1;
      if (c[seg].cls != CharClass::number)
        while (seg_end < n && c[seg_end].cls != CharClass::number) ++seg_end;
    }
    for (std::size_t i = seg; i < seg_end;) {
      const std::size_t j = match(i, seg_end);
      encode_word(text.substr(c[i].offset, c[j].offset - c[i].offset), s, out);
      i = j;
    }
    seg = seg_end;
  }
}

// Byte-level BPE on one pre-token: start from one symbol per byte and apply the best-ranked
// merge present until none applies. Stale heap entries are skipped when popped: a symbol
// that took part in a merge changed its id (or died), which the entry's ids no longer match.
void Tokenizer::encode_word(std::string_view word, Scratch& s, std::vector<std::int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_token_[static_cast<unsigned char>(word[0])]);
    return;
  }
  // Llama 3 takes a pre-token that is itself a token as it is, whatever its merges would give.
  if (pre_ == PreTokenizer::llama3)
    if (const auto it = whole_ids_.find(std::string(word)); it != whole_ids_.end()) return out.push_back(it->second);
  const auto size = static_cast<std::int32_t>(word.size());
  auto& sym = s.symbols;
  auto& heap = s.heap;
  sym.clear();
  heap.clear();
  for (std::int32_t i = 0; i < size; ++i)
    sym.push_back({byte_token_[static_cast<unsigned char>(word[i])], i - 1, i + 1 < size ? i + 1 : -1});
  const auto push = [&](std::int32_t left) {
    const std::int32_t right = sym[left].next;
    if (right < 0) return;
    if (const Merge* m = find_merge(sym[left].id, sym[right].id)) {
      heap.push_back({m->rank, left, sym[left].id, sym[right].id, m->result});
      std::ranges::push_heap(heap, std::greater<>{});
    }
  };
  for (std::int32_t i = 0; i + 1 < size; ++i) push(i);

  while (!heap.empty()) {
    std::ranges::pop_heap(heap, std::greater<>{});
    const Scratch::Candidate top = heap.back();
    heap.pop_back();
    Scratch::Symbol& left = sym[top.left];
    if (left.id != top.left_id || left.next < 0 || sym[left.next].id != top.right_id) continue;
    Scratch::Symbol& right = sym[left.next];
    left.id = top.result;
    right.id = -1;
    left.next = right.next;
    if (left.next >= 0) sym[left.next].prev = top.left;
    if (left.prev >= 0) push(left.prev);
    push(top.left);
  }
  for (std::int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

void Tokenizer::encode_spm(std::string_view text, std::vector<std::int32_t>& out) const {
  struct Symbol {
    std::size_t offset, n;  // n 0: merged into its left neighbour
    int prev, next;
  };
  struct Bigram {
    int left, right;
    float score;
    std::size_t size;
    // Highest score first, then leftmost: the order llama.cpp's SPM queue pops.
    bool operator<(const Bigram& o) const { return score < o.score || (score == o.score && left > o.left); }
  };
  std::vector<Symbol> sym;
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t n = std::min(utf8_len(static_cast<unsigned char>(text[at])), text.size() - at);
    const int index = static_cast<int>(sym.size());
    sym.push_back({at, n, index - 1, at + n == text.size() ? -1 : index + 1});
    at += n;
  }
  std::vector<Bigram> queue;
  std::map<std::string, std::pair<int, int>, std::less<>> rev_merge;  // merged text -> the pair that formed it
  const auto token_of = [&](std::string_view piece) {
    const auto it = whole_ids_.find(std::string(piece));
    return it == whole_ids_.end() ? -1 : it->second;
  };
  const auto try_add = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const std::string_view merged = text.substr(sym[left].offset, sym[left].n + sym[right].n);
    const int id = token_of(merged);
    if (id < 0) return;
    queue.push_back({left, right, scores_[id], merged.size()});
    std::push_heap(queue.begin(), queue.end());
    rev_merge[std::string(merged)] = {left, right};
  };
  for (int i = 1; i < static_cast<int>(sym.size()); ++i) try_add(i - 1, i);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end());
    const Bigram b = queue.back();
    queue.pop_back();
    Symbol& left = sym[b.left];
    Symbol& right = sym[b.right];
    if (left.n == 0 || right.n == 0 || left.n + right.n != b.size) continue;
    left.n += right.n;
    right.n = 0;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = b.left;
    try_add(left.prev, b.left);
    try_add(b.left, left.next);
  }
  // A symbol that is no token splits back along the merge that formed it, else into its bytes.
  const std::function<void(const Symbol&)> resegment = [&](const Symbol& s) {
    const std::string_view piece = text.substr(s.offset, s.n);
    if (const int id = token_of(piece); id >= 0) return out.push_back(id);
    const auto p = rev_merge.find(piece);
    if (p == rev_merge.end()) {
      for (char ch : piece) out.push_back(byte_token_[static_cast<unsigned char>(ch)]);
      return;
    }
    resegment(sym[p->second.first]);
    resegment(sym[p->second.second]);
  };
  for (int i = sym.empty() ? -1 : 0; i != -1; i = sym[i].next) resegment(sym[i]);
}

const std::string& Tokenizer::token_piece(std::int32_t id) const {
  if (id < 0 || id >= vocab_size())
    throw TokenizerError("token id " + std::to_string(id) + " outside the vocabulary [0, " + std::to_string(vocab_size()) + ")");
  return pieces_[id];
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids) const {
  std::string text;
  for (std::int32_t id : ids) text += token_piece(id);
  return text;
}

bool Tokenizer::is_end_of_generation(std::int32_t id) const {
  return std::ranges::find(end_of_generation_, id) != end_of_generation_.end();
}

// The ChatML family: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, preceded by the
// template's default system message when the first message is not a system one, and followed
// by "<|im_start|>assistant\n" when a reply is to be generated.
std::vector<Tokenizer::ChatPiece> Tokenizer::chat_pieces(std::span<const ChatMessage> messages,
                                                         bool add_generation_prompt) const {
  if (chat_family_ == ChatFamily::none && chat_template_.empty())
    throw TokenizerError("the model has no chat template (tokenizer.chat_template) and no chat markers");
  if (chat_family_ == ChatFamily::none)
    throw TokenizerError("unsupported chat template (supported: the ChatML family, with <|im_start|>, and Gemma's, with "
                         "<start_of_turn>): \"" + template_excerpt(chat_template_) + "\"");
  if (chat_family_ == ChatFamily::gemma) return gemma_pieces(messages, add_generation_prompt);
  std::vector<ChatPiece> pieces;
  const auto turn = [&](std::string_view role, std::string_view content) {
    pieces.push_back({std::string(kImStart), true});
    pieces.push_back({std::string(role).append("\n").append(content), false});
    pieces.push_back({std::string(kImEnd), true});
    pieces.push_back({"\n", false});
  };
  if (default_system_ && !messages.empty() && messages[0].role != "system") turn("system", *default_system_);
  for (const ChatMessage& m : messages) turn(m.role, m.content);
  if (add_generation_prompt) {
    pieces.push_back({std::string(kImStart), true});
    pieces.push_back({"assistant\n", false});
  }
  return pieces;
}

// Gemma: "<start_of_turn>{role}\n{content, trimmed}<end_of_turn>\n" per message, the assistant
// called "model", a leading system message written before the first user message's content
// with a blank line, then "<start_of_turn>model\n" when a reply is to be generated.
std::vector<Tokenizer::ChatPiece> Tokenizer::gemma_pieces(std::span<const ChatMessage> messages,
                                                          bool add_generation_prompt) {
  const auto trim = [](std::string_view v) {
    const std::string_view ws = " \t\n\r\f\v";
    const std::size_t b = v.find_first_not_of(ws);
    return b == std::string_view::npos ? std::string() : std::string(v.substr(b, v.find_last_not_of(ws) - b + 1));
  };
  std::vector<ChatPiece> pieces;
  std::string prefix;
  std::size_t i = 0;
  if (!messages.empty() && messages[0].role == "system") {
    prefix = trim(messages[0].content) + "\n\n";
    i = 1;
  }
  for (bool first = true; i < messages.size(); ++i, first = false) {
    const std::string role = messages[i].role == "assistant" ? "model" : messages[i].role;
    pieces.push_back({std::string(kStartOfTurn), true});
    pieces.push_back({role + "\n" + (first ? prefix : std::string()) + trim(messages[i].content), false});
    pieces.push_back({std::string(kEndOfTurn), true});
    pieces.push_back({"\n", false});
  }
  if (add_generation_prompt) {
    pieces.push_back({std::string(kStartOfTurn), true});
    pieces.push_back({"model\n", false});
  }
  return pieces;
}

std::string Tokenizer::apply_chat_template(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  std::string out;
  for (const ChatPiece& p : chat_pieces(messages, add_generation_prompt)) out += p.text;
  return out;
}

std::vector<std::int32_t> Tokenizer::encode_chat(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  std::vector<std::int32_t> out;
  for (const ChatPiece& p : chat_pieces(messages, add_generation_prompt)) {
    const std::vector<std::int32_t> ids = encode(p.text, /*parse_special=*/p.marker);
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}

}  // namespace witcert::model
