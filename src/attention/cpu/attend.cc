#include "attention/cpu/attend.h"

#include <algorithm>
#include <vector>

// The kernel keeps small arrays of vectors, which sizeless vector types (SVE, RVV) do not allow.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/cpu/attend.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "attention/cpu/keys-inl.h"
#include "attention/cpu/softmax-inl.h"
#include "attention/cpu/values-inl.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

void DitherValuesFast(const formats::DitherStream& stream, std::uint32_t counter, float* xi, int d) {
  std::vector<std::uint32_t> words(static_cast<std::size_t>(d) + 4 * hn::MaxLanes(hn::ScalableTag<std::uint32_t>()));
  std::vector<float> out(words.size());
  DitherRow(stream, counter, d, out.data(), words.data());
  std::copy_n(out.begin(), d, xi);
}

void DecodePackedRow(formats::PackedLayout layout, const std::uint8_t* in, int d, float* out) {
  PackedDecoder(layout, d)(in, d, out);
}

void DecodeGroupRows(formats::GroupLayout layout, const std::uint8_t* block, int d, int first, int count, float* out) {
  const std::size_t dp = hwy::RoundUpTo(static_cast<std::size_t>(d), kNF);
  Workspace::GroupBlock b;
  group::Reserve(b, layout, d, dp);
  group::Prepare(layout, block, d, b);
  std::vector<float> rows(count * dp);
  group::Decoder(layout)(block, d, b, first, count, rows.data(), dp);
  for (int t = 0; t < count; ++t) std::copy_n(&rows[t * dp], d, out + static_cast<std::size_t>(t) * d);
}

// One driver per pair of key and value formats, chosen once per call.
template <class Keys, class Values>
void AttendWith(Workspace& work, kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim, std::int64_t begin,
         std::int64_t end, const BoundContext& ctx, std::vector<HeadPartial>& partials, bool meter) {
  Attention<Keys, Values>(work, reader, q, group, head_dim, ctx, meter).Run(begin, end, partials);
}

// The trait of a side's format: dither-int8, a scheme with a SIMD decoder (per-token, or a group
// scheme's keys), or the black-box decode.
enum class Side { dither_int8, packed, decoded };
Side SideOf(const kvcache::KvStore::Reader& reader, formats::KvSide side, int head_dim) {
  if (reader.kind(side) == kvcache::FormatKind::dither) return Side::dither_int8;
  const formats::KvScheme* scheme = reader.scheme(side);
  if (scheme == nullptr) return Side::decoded;
  if (scheme->tokens_per_block() == 1 && PackedDecoder(scheme->layout(), head_dim) != nullptr) return Side::packed;
  if (side == formats::KvSide::key && scheme->tokens_per_block() == group::kTokens && group::Decoder(scheme->group_layout()) != nullptr)
    return Side::packed;
  return Side::decoded;
}

template <class Keys>
void AttendWithKeys(Workspace& work, kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
             std::int64_t begin, std::int64_t end, const BoundContext& ctx, std::vector<HeadPartial>& partials,
             bool meter) {
  switch (SideOf(reader, formats::KvSide::value, head_dim)) {
    case Side::dither_int8:
      return AttendWith<Keys, DitherInt8Values>(work, reader, q, group, head_dim, begin, end, ctx, partials, meter);
    case Side::packed:
      return AttendWith<Keys, PackedValues>(work, reader, q, group, head_dim, begin, end, ctx, partials, meter);
    case Side::decoded:
      return AttendWith<Keys, DecodedValues>(work, reader, q, group, head_dim, begin, end, ctx, partials, meter);
  }
}

void AttendRange(Workspace& work, kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                 std::int64_t begin, std::int64_t end, const BoundContext& ctx, std::vector<HeadPartial>& partials,
                 bool meter) {
  switch (SideOf(reader, formats::KvSide::key, head_dim)) {
    case Side::dither_int8:
      return AttendWithKeys<DitherInt8Keys>(work, reader, q, group, head_dim, begin, end, ctx, partials, meter);
    case Side::packed:
      return AttendWithKeys<PackedKeys>(work, reader, q, group, head_dim, begin, end, ctx, partials, meter);
    case Side::decoded:
      return AttendWithKeys<DecodedKeys>(work, reader, q, group, head_dim, begin, end, ctx, partials, meter);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace witcert::kernel {

HWY_EXPORT(AttendRange);
HWY_EXPORT(DitherValuesFast);
HWY_EXPORT(DecodePackedRow);
HWY_EXPORT(UnpackCodes);
HWY_EXPORT(DecodeGroupRows);

void attend_range(Workspace& work, kvcache::KvStore::Reader& reader, const float* q, int group, int head_dim,
                  std::int64_t begin, std::int64_t end, const attention::BoundContext& ctx,
                  std::vector<attention::HeadPartial>& partials, bool meter) {
  if (reader.config().reference_keys())  // no fast path: the evaluation's reference options
    return attention::attend_range_reference(reader, q, group, head_dim, begin, end, ctx, partials);
  HWY_DYNAMIC_DISPATCH(AttendRange)(work, reader, q, group, head_dim, begin, end, ctx, partials, meter);
}

void unpack_codes_fast(const std::uint8_t* run, int bits, std::size_t n, std::int8_t* out) {
  HWY_DYNAMIC_DISPATCH(UnpackCodes)(run, bits, n, out);
}

void decode_packed_row(formats::PackedLayout layout, const std::uint8_t* in, int d, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodePackedRow)(layout, in, d, out);
}

void decode_group_rows(formats::GroupLayout layout, const std::uint8_t* block, int d, int first, int count, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeGroupRows)(layout, block, d, first, count, out);
}

void dither_values_fast(const formats::DitherStream& stream, std::uint32_t counter, std::span<float> xi) {
  HWY_DYNAMIC_DISPATCH(DitherValuesFast)(stream, counter, xi.data(), static_cast<int>(xi.size()));
}

}  // namespace witcert::kernel
#endif  // HWY_ONCE
