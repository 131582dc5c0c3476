// The subtractively dithered B-bit quantizer of Tier B (paper §4.2, §6.2.1), B ∈ {4, 5, 6, 8}:
//   x̂ = s · (round(x/s + ξ) − ξ),   ξ ~ U[−½, ½) regenerated from Philox at read time,
// per token × group of G_c channels (ScaleGranularity::token), or per channel × block of tokens
// (ScaleGranularity::channel, the paper's Tables 1 and 4), with s = amax/(Q − ½), Q = 2^(B−1) − 1,
// over the non-outlier values the scale covers, stored fp16 rounded up and used as stored, so
// |x/s| ≤ Q − ½: no clipping
// (|code| ≤ Q) and |x̂ − x| ≤ s/2 on every non-outlier channel, at any B. Outlier channels are
// stored in fp16 (exact) and excluded from the amax. Below 8 bits the pool packs the codes
// (code_pack.h); here they are one int8 each.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "base/fp16.h"

namespace witcert::formats {

inline constexpr int kDefaultGroup = 32;     // G_c
inline constexpr int kChannelBlock = 256;    // tokens per block of per-channel scales

// What one scale of dithered keys covers: a token's group of kDefaultGroup channels, or one
// channel over a block of kChannelBlock tokens (its key is encoded when the block is complete).
enum class ScaleGranularity { token, channel };
// "token", "channel"; parse_scale_granularity throws std::invalid_argument on anything else.
const char* scale_granularity_name(ScaleGranularity g);
ScaleGranularity parse_scale_granularity(const std::string& name);
// The bit widths of the dithered formats, "dither-int<B>".
inline constexpr int kDitherBits[] = {4, 5, 6, 8};

// Q = 2^(B−1) − 1, the largest code of B bits, and the scale divisor Q − ½.
constexpr int dither_max_code(int bits) { return (1 << (bits - 1)) - 1; }
constexpr double dither_scale_divisor(int bits) { return dither_max_code(bits) - 0.5; }

// The dither stream of one (layer, KV head) of one request. The Philox counter is
// (slot, channel/4, kv_head, layer) under key (seed_lo, seed_hi): it names the physical slot,
// not the position, so paging and slot reuse regenerate exactly the stream that was written.
struct DitherStream {
  std::uint64_t seed = 0;
  std::uint32_t layer = 0;
  std::uint32_t kv_head = 0;
};

// Values draw their dither from a stream of their own: the layer word's top bit is set, so that no
// value counter is ever a key counter (the two sides' dithers are independent).
inline constexpr std::uint32_t kValueStreamBit = 0x80000000u;
constexpr DitherStream value_stream(DitherStream s) {
  s.layer |= kValueStreamBit;
  return s;
}

// ξ from one 32-bit Philox word: the top 24 bits on the grid k·2^-24 − ½, exact in float.
constexpr float dither_from_bits(std::uint32_t u) {
  return static_cast<float>(u >> 8) * 0x1p-24f - 0.5f;
}

// ξ_c for channels c = 0 .. xi.size()−1 of `slot`.
void dither_values(const DitherStream& stream, std::uint32_t slot, std::span<float> xi);

// Checks that `group` divides d; throws std::invalid_argument otherwise.
void check_group(int d, int group);

// Encodes one token in B-bit codes. x: the token's values (rounded to fp16 first: the reference is the value
// the exact tier holds); xi: its dither; outlier: 1 for channels kept exact. Writes d codes
// (0 on outlier channels), d/group fp16 scales, and the fp16 value of each outlier channel in
// channel order (outlier_values.size() = number of outlier channels).
// A group with a non-finite value gets scale +inf: the certificate then reads "no guarantee".
void encode_dither(int bits, std::span<const float> x, std::span<const float> xi,
                        std::span<const std::uint8_t> outlier, int group, std::span<std::int8_t> codes,
                        std::span<f16> scales, std::span<f16> outlier_values);

// Per-channel scales over n tokens (rows [t][d] of x, rounded to fp16 first as encode_dither
// does): scales[c] = amax_t |x_{t,c}| / (Q − ½) rounded up to fp16, +inf for a channel with a
// non-finite value, 0 on outlier channels (never read).
void dither_channel_scales(int bits, std::span<const float> x, int n, std::span<const std::uint8_t> outlier,
                           std::span<f16> scales);

// Encodes one token against given scales (one per `group` channels): encode_dither's codes and
// outlier values, with scales that cover the token (|x_c| ≤ (Q − ½)·s_{g(c)} on non-outlier channels).
void encode_dither_scaled(std::span<const float> x, std::span<const float> xi, std::span<const std::uint8_t> outlier,
                          std::span<const f16> scales, int group, std::span<std::int8_t> codes,
                          std::span<f16> outlier_values);

// x̂_c = s_{g(c)} · (code_c − ξ_c) on non-outlier channels, the stored fp16 value on outliers.
void decode_dither(std::span<const std::int8_t> codes, std::span<const f16> scales,
                        std::span<const float> xi, std::span<const std::uint8_t> outlier,
                        std::span<const f16> outlier_values, int group, std::span<float> out);

}  // namespace witcert::formats
