// The fused certified decode attention (paper §6.2; DESIGN §2, the kernel layer): the partials of
// attention::attend_range_reference (attention/reference/certified_attention.h), with the same merge semantics, from
// one pass over a token range, in SIMD code compiled for every target Highway knows and chosen at
// run time. README.md says how the folder is cut.
//
// The range is cut into tiles of at most 128 positions. Each tile's keys and values are decoded
// once for all `group` query heads of the KV head (GQA): keys into double rows (dither-int8:
// s_g·code, or s_g·(code − ξ) with the per-slot dither, both exact in double), values into float
// rows. Logits z̃_t, bounds c_t and the three log-sum-exps are then computed with the tile's tokens
// in SIMD lanes, in double; the output accumulates in float per tile and in double across tiles.
// Shared-page dither-int8 keys, the certified cache's default, take a float path: codes with the
// tokens in lanes, logits and c_t in float with a proven rounding allowance in c_t
// (docs/proofs/float-path.md), softmax weights in float with a proven allowance in the meter
// (cert::float_weight_error); their c_t enter the meter through its moments
// (cert::MeterStats::add_moment), as the reference takes the same tokens. The scalar reference
// stays the oracle (attend_test.cc): the float path's meter is within about 1e-3 of it and never
// below it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attention/cpu/workspace.h"
#include "attention/reference/certified_attention.h"
#include "formats/dither/dither.h"
#include "formats/schemes.h"
#include "kvcache/kv_store.h"

namespace witcert::kernel {

// Accumulates tokens [begin, end) of one (layer, KV head) into one partial per query head, as
// attend_range_reference does, with work's buffers (grown on first use, then reused: no allocation
// once work and partials have served a call of this size). meter = false skips the whole meter
// (c_t, LSE(z̃ ± c), and the value side: ρ_t, ‖v̂_t‖, Σ p̃_t ρ_t and max_t(‖v̂_t‖ + ρ_t)),
// leaving the partials' meter and value terms incomplete: it exists only to measure what the meter
// costs (bench/attention_bench.cc).
void attend_range(Workspace& work, kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                  std::int64_t begin, std::int64_t end, const attention::BoundContext& ctx,
                  std::vector<attention::HeadPartial>& partials, bool meter = true);

// One token of a packed scheme (formats::PackedLayout, not opaque) decoded by the kernel's SIMD
// decoder (exposed for its test against formats::KvScheme::decode). d: the head dimension, at most
// 1,024 for rot-4bit (beyond, the kernel takes its black-box decode).
void decode_packed_row(formats::PackedLayout layout, const std::uint8_t* in, int d, float* out);
// The kernel's unpacking of dithered codes below 8 bits: bit for bit formats::unpack_codes.
void unpack_codes_fast(const std::uint8_t* run, int bits, std::size_t n, std::int8_t* out);

// Tokens [first, first + count) of a group scheme's block (formats::GroupLayout, not opaque) decoded
// by the kernel's SIMD decoder into out (count × d floats, token-major), as formats::KvScheme::decode
// gives those rows of the block (exposed for its test).
void decode_group_rows(formats::GroupLayout layout, const std::uint8_t* block, int d, int first, int count, float* out);

// formats::dither_values computed by the kernel's vectorized Philox4x32-10 (exposed for its
// known-answer test). xi.size() must be a multiple of 4.
void dither_values_fast(const formats::DitherStream& stream, std::uint32_t counter, std::span<float> xi);

}  // namespace witcert::kernel
