// Building blocks the KV schemes share: little-endian fp16 fields, packed b-bit code fields, the
// two round-to-nearest quantizer records (symmetric absmax, asymmetric min/max), the base classes
// of the per-token schemes, and the lists each family hands to the registry.
//
// Both quantizers store their step in fp16 rounded so that no code ever clips: the stored step is
// the one quantized with, so |v̂ − v| ≤ s/2 holds for every value with the stored s.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "base/fp16.h"
#include "formats/schemes.h"

namespace witcert::formats::kit {

inline constexpr int kChannelGroup = 32;  // channels per scale record of the per-token schemes
inline constexpr int kBlockTokens = 32;   // T of the group schemes (KIVI and KVQuant keys)

inline void store_f16(std::uint8_t* p, f16 h) {
  p[0] = static_cast<std::uint8_t>(h & 0xFF);
  p[1] = static_cast<std::uint8_t>(h >> 8);
}
inline f16 load_f16(const std::uint8_t* p) { return static_cast<f16>(p[0] | (p[1] << 8)); }

// The largest fp16 value ≤ v.
inline f16 fp16_down(double v) { return fp16_from_double(-v, Round::up) ^ 0x8000; }

// n elements of this thread's scratch array number kSlot of type T, reused by every codec call on
// the thread: a codec allocates only while the array grows, so a cache's writes allocate nothing
// once warm. The contents are whatever the last user left; a call needing two arrays of one type
// at once takes two slots, and a function's arrays must not share a slot with its callers'.
template <class T, int kSlot = 0>
std::span<T> scratch(std::size_t n) {
  thread_local std::vector<T> array;
  if (array.size() < n) array.resize(n);
  return {array.data(), n};
}

// n fields of `bits` ∈ {1, 2, 4, 8} bits, field i in byte bits·i/8 from its lowest bit up.
inline std::size_t packed_bytes(int n, int bits) { return (static_cast<std::size_t>(n) * bits + 7) / 8; }
void pack(std::span<const unsigned> fields, int bits, std::uint8_t* out);  // writes packed_bytes(n, bits)
unsigned unpack(const std::uint8_t* in, int i, int bits);

// Symmetric absmax RTN record of n values: [fp16 s][n codes of `bits` bits], s = amax/q_max stored
// rounded up (q_max = 2^(bits−1) − 1), code q = round(v/s) ∈ [−q_max, q_max] stored offset binary
// as q + 2^(bits−1); v̂ = s·q. A record holding a non-finite value stores s = +inf and q = 0, which
// decode to NaN.
inline std::size_t symmetric_bytes(int n, int bits) { return 2 + packed_bytes(n, bits); }
void encode_symmetric(std::span<const double> v, int bits, std::uint8_t* out);
void decode_symmetric(const std::uint8_t* in, int bits, std::span<double> out);

// Asymmetric min/max RTN record of n values: [fp16 s][fp16 lo][n codes of `bits` bits],
// lo = min v rounded down, s = (max v − lo)/(2^bits − 1) rounded up, code = round((v − lo)/s);
// v̂ = lo + s·code. Values with skip[i] ≠ 0 are left out of the range and get code 0 (KVQuant
// stores them elsewhere); an empty skip spares none. A non-finite value in the range stores
// s = +inf and code 0, which decode to NaN.
inline std::size_t asymmetric_bytes(int n, int bits) { return 4 + packed_bytes(n, bits); }
void encode_asymmetric(std::span<const double> v, int bits, std::uint8_t* out, std::span<const std::uint8_t> skip = {});
void decode_asymmetric(const std::uint8_t* in, int bits, std::span<double> out);

// Throws std::invalid_argument "<scheme>: <requirement>, got <head_dim>" unless ok.
void require(bool ok, std::string_view scheme, std::string_view requirement, int head_dim);

// A scheme that encodes each token vector on its own, the moment it is written.
class PerToken : public KvScheme {
 public:
  int tokens_per_block() const override { return 1; }
};

// Per-token schemes made of one quantizer record per group of 32 channels.
class Grouped : public PerToken {
 public:
  void check_head_dim(int d) const override {
    require(d > 0 && d % kChannelGroup == 0, name(), "head_dim must be a positive multiple of 32", d);
  }
  std::size_t block_bytes(int d) const override {
    check_head_dim(d);
    return static_cast<std::size_t>(d / kChannelGroup) * record_bytes();
  }
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    const std::span<double> v = scratch<double>(d);
    std::copy(x, x + d, v.begin());
    encode_token(v, out);
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    const std::span<double> v = scratch<double>(d);
    decode_token(in, v);
    std::transform(v.begin(), v.end(), out, [](double y) { return static_cast<float>(y); });
  }

 protected:
  virtual std::size_t record_bytes() const = 0;
  virtual void encode_group(std::span<const double> v, std::uint8_t* out) const = 0;
  virtual void decode_group(const std::uint8_t* in, std::span<double> out) const = 0;
  void encode_token(std::span<const double> v, std::uint8_t* out) const {
    for (std::size_t g = 0; g < v.size() / kChannelGroup; ++g)
      encode_group(v.subspan(g * kChannelGroup, kChannelGroup), out + g * record_bytes());
  }
  void decode_token(const std::uint8_t* in, std::span<double> out) const {
    for (std::size_t g = 0; g < out.size() / kChannelGroup; ++g)
      decode_group(in + g * record_bytes(), out.subspan(g * kChannelGroup, kChannelGroup));
  }
};

// The registry's view of one scheme family: a name and its key-side and value-side schemes.
struct SchemeEntry {
  std::string_view name;
  const KvScheme* key;
  const KvScheme* value;
};
// Each family's entries, in the registry's order (schemes.cc).
std::vector<SchemeEntry> fp16_schemes();      // fp16/fp16_scheme.cc
std::vector<SchemeEntry> fp8_schemes();       // fp8/fp8_schemes.cc
std::vector<SchemeEntry> rtn_schemes();       // rtn/rtn_schemes.cc
const KvScheme& kivi_value_scheme();          // rtn/rtn_schemes.cc: rtn-2bit under KIVI's name
std::vector<SchemeEntry> sign_schemes();      // sign/sign1bit.cc
std::vector<SchemeEntry> rotation_schemes();  // rotation/rot4bit.cc
std::vector<SchemeEntry> group_schemes();     // group/group_schemes.cc
std::vector<SchemeEntry> ggml_schemes();      // ggml/ggml_schemes.cc

}  // namespace witcert::formats::kit
