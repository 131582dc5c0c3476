// The two tokenizers GGUF models ship, and their chat formats.
//
// Byte-level BPE (tokenizer model "gpt2": Llama 3, Qwen, SmolLM): special tokens are cut out of
// the text first, the rest is split into pre-tokens (the GPT-2 regex, preceded by a one-digit
// split for the "smollm" family; Llama 3's regex, numbers in runs of up to three digits, for the
// "llama-bpe" family; Qwen 2's, single digits, for "qwen2"), each pre-token's bytes are mapped to
// GPT-2's printable byte alphabet and merged by rank (Llama 3 takes a pre-token that is a token
// as it is).
// SentencePiece BPE (tokenizer model "llama": Gemma, Llama 2, Mistral): special tokens are cut
// out the same way; each remaining fragment has its spaces written as U+2581, is split into
// UTF-8 characters and merged pair by pair, the pair whose merged text is the highest-scoring
// token first (leftmost on a tie), as llama.cpp's SPM tokenizer does; a character left without
// a token becomes its bytes' <0xXX> tokens.
// Decoding maps the pieces back to bytes, so decode(encode(x)) == x for any byte string whose
// bytes all have a token, valid UTF-8 or not (SentencePiece: the text after any space prefix).
//
// A Tokenizer does not change after construction: concurrent calls need no locking.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace witcert::model {

class GgufFile;

class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Token types as stored in tokenizer.ggml.token_type.
enum class TokenType : std::int32_t {
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,
};

// Everything a tokenizer is built from: the tokenizer.* metadata of a GGUF file.
struct Vocab {
  std::string model = "gpt2";            // tokenizer.ggml.model: "gpt2" or "llama" (SentencePiece)
  std::vector<std::string> tokens;       // byte-level strings, or literal text for special tokens
  std::vector<float> scores;             // SentencePiece: the merge priority of each token
  std::vector<std::int32_t> token_types; // TokenType values; empty means all normal
  std::vector<std::string> merges;       // "left right", highest priority first
  std::int32_t bos = -1, eos = -1, unk = -1, pad = -1;  // -1: the model has none
  std::string pre;                       // pre-tokenizer name (tokenizer.ggml.pre)
  bool add_bos = false;
  bool add_space_prefix = false;         // SentencePiece: a space before text that follows a special token or starts
  std::string chat_template;             // Jinja source, as shipped with the model
};

struct ChatMessage {
  std::string role, content;
};

class Tokenizer {
 public:
  // Throws TokenizerError on an inconsistent vocabulary (type count, a special id out of
  // range, a malformed merge, a byte missing from the byte alphabet while the model has no
  // unknown token). A pre-tokenizer name outside the "smollm" family (see tokenizer.cc) selects
  // the plain GPT-2 regex.
  static Tokenizer from_vocab(Vocab vocab);
  // Throws TokenizerError when the file has no tokenizer or one other than "gpt2" or "llama".
  static Tokenizer from_gguf(const GgufFile& file);

  // Token ids of text. Control tokens written in the text (<|im_start|>) become their ids when
  // parse_special, and ordinary text otherwise; user-defined tokens are always recognised. The
  // chat markers and end-of-turn texts (<|im_start|>, <|im_end|>, <|endoftext|>) count as control
  // tokens whatever type the file gives them, so that text encoded without parse_special never
  // forges one.
  // A byte without a token becomes unk. Never prepends bos: callers do when add_bos().
  std::vector<std::int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Concatenated token_piece of every id.
  std::string decode(std::span<const std::int32_t> ids) const;
  // Bytes of one token (possibly part of a UTF-8 character); the literal text for control and
  // user-defined tokens. Throws TokenizerError for an id outside [0, vocab_size()).
  const std::string& token_piece(std::int32_t id) const;

  std::int32_t vocab_size() const { return static_cast<std::int32_t>(pieces_.size()); }
  std::int32_t bos() const { return bos_; }
  std::int32_t eos() const { return eos_; }
  bool add_bos() const { return add_bos_; }
  // ids with bos in front when the model asks for it (add_bos_token), as llama.cpp adds it.
  std::vector<std::int32_t> with_bos(std::vector<std::int32_t> ids) const {
    if (add_bos_ && bos_ >= 0) ids.insert(ids.begin(), bos_);
    return ids;
  }
  // eos, and the end-of-turn/end-of-text tokens (<|im_end|>, <|endoftext|>) a chat model emits.
  bool is_end_of_generation(std::int32_t id) const;

  // The prompt the model's chat template renders for these messages, formatted natively for the
  // known families: ChatML (templates containing "<|im_start|>", with the default system message
  // such templates insert when the first message is not one) and Gemma ("<start_of_turn>": the
  // assistant is "model", a system message opens the first user turn, contents are trimmed). A
  // GGUF without a template gets the family its special tokens name. Throws TokenizerError naming
  // the template otherwise.
  std::string apply_chat_template(std::span<const ChatMessage> messages, bool add_generation_prompt) const;
  // The token ids of that prompt, which every chat caller feeds the model: the template's own
  // markers become their tokens and each role and content is encoded with parse_special off, so
  // that a message cannot open or close a turn. decode() of the result is apply_chat_template's
  // text, and its ids are those of encode(that text) whenever no message writes a control token.
  // Throws as apply_chat_template.
  std::vector<std::int32_t> encode_chat(std::span<const ChatMessage> messages, bool add_generation_prompt) const;

 private:
  Tokenizer() = default;
  struct Merge {
    std::int32_t rank, result;
  };
  struct Special {
    std::string text;
    std::int32_t id;
    bool control;  // recognised only when parse_special
  };
  struct Scratch;
  // A piece of a rendered chat prompt: one of the template's markers, or the text between two.
  struct ChatPiece {
    std::string text;
    bool marker;
  };

  // The chat prompt of apply_chat_template as its pieces, in order.
  std::vector<ChatPiece> chat_pieces(std::span<const ChatMessage> messages, bool add_generation_prompt) const;
  static std::vector<ChatPiece> gemma_pieces(std::span<const ChatMessage> messages, bool add_generation_prompt);

  void encode_fragment(std::string_view text, Scratch& s, std::vector<std::int32_t>& out) const;
  // SentencePiece: one fragment (spaces already written as U+2581).
  void encode_spm(std::string_view text, std::vector<std::int32_t>& out) const;
  void encode_word(std::string_view word, Scratch& s, std::vector<std::int32_t>& out) const;
  const Merge* find_merge(std::int32_t left, std::int32_t right) const;

  std::vector<std::string> pieces_;              // bytes of each token
  std::array<std::int32_t, 256> byte_token_{};   // token of each single byte (unk if none)
  std::unordered_map<std::uint64_t, Merge> merges_;  // (left id, right id) -> rank, result
  std::vector<Special> specials_;                // longest first
  std::array<bool, 256> special_first_byte_{};
  std::vector<std::int32_t> end_of_generation_;
  bool split_digits_ = false;
  // The regex that splits text into pre-tokens: GPT-2's (with split_digits_ for the "smollm"
  // family), Llama 3's or Qwen 2's.
  enum class PreTokenizer { gpt2, llama3, qwen2 } pre_ = PreTokenizer::gpt2;
  std::int32_t bos_ = -1, eos_ = -1;
  bool add_bos_ = false;
  bool spm_ = false;                                    // SentencePiece
  // The id of a whole token's text as encoding looks it up: SentencePiece's token text (U+2581 for
  // spaces), or Llama 3's normal tokens' bytes (a pre-token that is one is taken whole); else empty.
  std::unordered_map<std::string, std::int32_t> whole_ids_;
  std::vector<float> scores_;
  bool add_space_prefix_ = false;
  std::string chat_template_;
  enum class ChatFamily { none, chatml, gemma } chat_family_ = ChatFamily::none;
  std::optional<std::string> default_system_;
};

}  // namespace witcert::model
