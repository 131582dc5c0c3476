// The scheme registry (DESIGN §2, the formats layer): black-box KV-cache compressors the Tier-A witness
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

namespace witcert::formats {

enum class KvSide { key, value };

// The byte layout of a per-token scheme whose decode is a fixed function of its bytes, for the
// attention kernel's own SIMD decoders (src/attention/cpu/packed-inl.h): each of these decodes x̂_c as a
// product that is exact in float (an fp16 scale times a code of at most 8 significant bits, plus
// an fp16 offset for q4_1, q5_1, rtn_2bit and kvquant4_token, rounded once as decode rounds it),
// so every decoder gives the floats decode gives, bit for bit; rot_4bit's decoder proves its own
// (attention/cpu/rotation-inl.h). opaque: only decode knows the bytes.
enum class PackedLayout {
  opaque,
  fp16,             // d fp16 values
  fp8_e4m3,         // d fp8 codes, no scale
  fp8_e4m3_scaled,  // [fp16 s][d fp8 codes]
  rtn_int8,         // per 32 channels: [fp16 s][32 bytes], x̂ = s·(byte − 128)
  rtn_int4,         // per 32 channels: [fp16 s][16 bytes], channel i in nibble i mod 2 of byte i/2, x̂ = s·(q − 8)
  q8_0,             // GGML blocks of 32 channels (formats/ggml/ggml_types.h)
  q4_0,
  q4_1,
  q5_0,
  q5_1,
  iq4_nl,
  rtn_2bit,        // per 32 channels: [fp16 s][fp16 lo][8 bytes], channel i in bits 2(i mod 4) of byte i/4, x̂ = lo + s·q
  sign_1bit,       // per 32 channels: [fp16 m][4 bytes], channel i in bit i mod 8 of byte i/8, x̂ = 1 ? −m : m
  rot_4bit,        // rtn_int4's bytes of the rotated token y = R·x; x̂ = Rᵀ·ŷ (formats/rotation/hadamard.h)
  kvquant4_token,  // [fp16 s][fp16 lo][d nibbles as rtn_int4][max(1, d/100) × (uint16 c, fp16 x̂_c)]
};

// The byte layout of a group scheme's block of T = 32 tokens, for the kernel's SIMD decoders
// (src/attention/cpu/group-inl.h), which give decode's floats bit for bit: per channel c an asymmetric
// record [fp16 s][fp16 lo][32 codes], token t's code in bits b·(t mod 8/b) of byte b·t/8, then
// for kvquant_4 max(1, 32·d/100) × (uint16 t·d + c, fp16 x̂). opaque: only decode knows the bytes.
enum class GroupLayout {
  opaque,
  kivi_2bit,  // b = 2: 12 bytes a channel
  kvquant_4,  // b = 4: 20 bytes a channel, then the outliers
};

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
  virtual PackedLayout layout() const { return PackedLayout::opaque; }
  virtual GroupLayout group_layout() const { return GroupLayout::opaque; }  // group schemes (T > 1)
  // Throws std::invalid_argument saying why when the scheme cannot encode heads of head_dim
  // values. block_bytes, encode and decode check it first.
  virtual void check_head_dim(int head_dim) const;
  double bytes_per_token(int head_dim) const;  // block_bytes / T
};

// The scheme `name` for one side of the cache (KIVI and KVQuant quantize keys per channel and
// values per token). Throws std::invalid_argument listing the known names for an unknown one.
const KvScheme& kv_scheme(std::string_view name, KvSide side = KvSide::key);
std::vector<std::string> kv_scheme_names();

}  // namespace witcert::formats
