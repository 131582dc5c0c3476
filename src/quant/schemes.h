// The scheme registry (DESIGN §2, layer 2): black-box KV-cache compressors the Tier-A witness
// meters. A scheme is a name, its byte cost, an encoder from exact fp16 vectors to its own packed
// bytes and a decoder back to floats; the cache stores the bytes and never looks inside them.
//
// A per-token scheme (tokens_per_block() = 1) encodes one token vector of head_dim values. A group
// scheme quantizes per channel along tokens, so it encodes a block of T > 1 tokens at once; the
// cache keeps tokens exact until their block fills.
//
// Non-finite input never decodes to a finite wrong value: a NaN or ±inf in a token makes the
// decoded values of its quantization group (at least its own position) non-finite, so a meter
// fed by the decoded keys reports "no guarantee".
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace witcert::quant {

enum class KvSide { key, value };

class KvScheme {
 public:
  virtual ~KvScheme() = default;
  virtual std::string_view name() const = 0;
  virtual int tokens_per_block() const = 0;  // 1: per-token scheme; T > 1: group scheme
  // Packed bytes of one block (T tokens × head_dim).
  virtual std::size_t block_bytes(int head_dim) const = 0;
  // x: T × head_dim values, token-major (x[t·head_dim + c]), the exact fp16 values as floats;
  // out: block_bytes(head_dim) bytes, every one of them written.
  virtual void encode(const float* x, int head_dim, std::uint8_t* out) const = 0;
  // in: block_bytes(head_dim) bytes; out: T × head_dim floats, token-major.
  virtual void decode(const std::uint8_t* in, int head_dim, float* out) const = 0;
  virtual bool exact() const { return false; }  // fp16 only
  // Throws std::invalid_argument saying why when the scheme cannot encode heads of head_dim
  // values. block_bytes, encode and decode check it first.
  virtual void check_head_dim(int head_dim) const;
  double bytes_per_token(int head_dim) const;  // block_bytes / T
};

// The scheme `name` for one side of the cache (KIVI and KVQuant quantize keys per channel and
// values per token). Throws std::invalid_argument listing the known names for an unknown one.
const KvScheme& kv_scheme(std::string_view name, KvSide side = KvSide::key);
std::vector<std::string> kv_scheme_names();

}  // namespace witcert::quant
