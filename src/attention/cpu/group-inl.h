// The group schemes' SIMD decoders (included per target after hwy/highway.h): kivi-2bit and
// kvquant-4 keys, whose block of 32 tokens holds one asymmetric record per channel
// (formats::GroupLayout). A block is first split into arrays with the channels in lanes (Prepare:
// s_c and lo_c as floats, each channel's codes as 32-bit words), then any of its tokens decodes as
// one row: x̂_{t,c} = lo_c + s_c·q_{t,c}. The product of an fp16 scale and a code of at most 4 bits
// is exact in float, so the fused multiply-add rounds the exact sum once, as decode's double sum
// (exact too) rounded to float does: the floats of formats::KvScheme::decode, bit for bit. kvquant-4's
// outliers then overwrite their entries in the order decode writes them.
#if defined(WITCERT_KERNEL_GROUP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_GROUP_INL_H_
#undef WITCERT_KERNEL_GROUP_INL_H_
#else
#define WITCERT_KERNEL_GROUP_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "base/fp16.h"
#include "hwy/highway.h"
#include "attention/cpu/simd-inl.h"
#include "attention/cpu/workspace.h"
#include "formats/schemes.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

namespace group {

constexpr int kTokens = 32;  // T of both group schemes

constexpr int Bits(formats::GroupLayout layout) { return layout == formats::GroupLayout::kivi_2bit ? 2 : 4; }
constexpr int RecordBytes(formats::GroupLayout layout) { return 4 + kTokens * Bits(layout) / 8; }
constexpr int Words(formats::GroupLayout layout) { return kTokens * Bits(layout) / 32; }  // 32-bit words of codes a channel
inline int OutlierCount(int d) { return std::max(1, kTokens * d / 100); }              // kvquant-4 keys

// Sizes the block buffers for head dimension d (rows of dp floats): the lanes past d stay zero, so
// that they decode to +0, the rows' padding.
inline void Reserve(Workspace::GroupBlock& b, formats::GroupLayout layout, int d, std::size_t dp) {
  b.s16.assign(d, 0);
  b.lo16.assign(d, 0);
  b.s.assign(dp, 0.0f);
  b.lo.assign(dp, 0.0f);
  b.words.assign(static_cast<std::size_t>(Words(layout)) * dp, 0);
  b.dp = dp;
}

// The block's records into b: s_c, lo_c, and word w of channel c's codes at words[w·dp + c].
inline void Prepare(formats::GroupLayout layout, const std::uint8_t* block, int d, Workspace::GroupBlock& b) {
  const int R = RecordBytes(layout), W = Words(layout);
  for (int c = 0; c < d; ++c) {
    const std::uint8_t* r = block + static_cast<std::size_t>(c) * R;
    std::memcpy(&b.s16[c], r, 2);
    std::memcpy(&b.lo16[c], r + 2, 2);
    for (int w = 0; w < W; ++w) std::memcpy(&b.words[w * b.dp + c], r + 4 + 4 * w, 4);
  }
  F16ToFloat(b.s16.data(), d, b.s.data());
  F16ToFloat(b.lo16.data(), d, b.lo.data());
}

// Tokens [first, first + count) of the prepared block into rows out + i·stride (stride ≥ dp;
// every row's dp floats written). block: the same block's bytes (kvquant-4's outliers).
template <formats::GroupLayout L>
void Rows(const std::uint8_t* block, int d, const Workspace::GroupBlock& b, int first, int count, float* out,
          std::size_t stride) {
  const DF df;
  const hn::Rebind<std::int32_t, DF> di32;
  const hn::Rebind<std::uint32_t, DF> du32;
  constexpr int kBits = Bits(L), kPerWord = 32 / kBits;
  const auto mask = hn::Set(du32, (1u << kBits) - 1);
  const std::size_t dp = b.dp;
  for (int t = first; t < first + count; ++t) {
    const std::uint32_t* words = &b.words[static_cast<std::size_t>(t / kPerWord) * dp];
    const int shift = kBits * (t % kPerWord);
    float* row = out + static_cast<std::size_t>(t - first) * stride;
    for (std::size_t c = 0; c < dp; c += kNF) {
      const auto q = hn::And(hn::ShiftRightSame(hn::LoadU(du32, words + c), shift), mask);
      const VF x = hn::MulAdd(hn::ConvertTo(df, hn::BitCast(di32, q)), hn::LoadU(df, &b.s[c]), hn::LoadU(df, &b.lo[c]));
      hn::StoreU(x, df, row + c);
    }
  }
  if constexpr (L == formats::GroupLayout::kvquant_4) {
    const std::uint8_t* o = block + static_cast<std::size_t>(d) * RecordBytes(L);
    const std::int64_t lo = static_cast<std::int64_t>(first) * d, hi = static_cast<std::int64_t>(first + count) * d;
    for (int k = 0; k < OutlierCount(d); ++k, o += 4) {
      const std::int64_t at = o[0] | (o[1] << 8);
      if (at < lo || at >= hi) continue;  // another row's (or, in bytes decode never wrote, past the block)
      f16 v;
      std::memcpy(&v, o + 2, 2);
      out[static_cast<std::size_t>(at / d - first) * stride + static_cast<std::size_t>(at % d)] = fp16_to_float(v);
    }
  }
}

using RowsFn = void (*)(const std::uint8_t*, int, const Workspace::GroupBlock&, int, int, float*, std::size_t);

// The rows decoder of a layout; nullptr for formats::GroupLayout::opaque.
inline RowsFn Decoder(formats::GroupLayout layout) {
  switch (layout) {
    case formats::GroupLayout::kivi_2bit: return Rows<formats::GroupLayout::kivi_2bit>;
    case formats::GroupLayout::kvquant_4: return Rows<formats::GroupLayout::kvquant_4>;
    case formats::GroupLayout::opaque: break;
  }
  return nullptr;
}

}  // namespace group

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_GROUP_INL_H_
