// ξ of dither-int8 in SIMD: Philox4x32-10 with the counters in lanes, as formats::dither_values
// computes it one counter at a time (included per target after hwy/highway.h; its known-answer
// test is attend_test.cc's DitherMatchesScalarPhilox).
#if defined(WITCERT_KERNEL_PHILOX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_PHILOX_INL_H_
#undef WITCERT_KERNEL_PHILOX_INL_H_
#else
#define WITCERT_KERNEL_PHILOX_INL_H_
#endif

#include <cstdint>
#include <span>

#include "hwy/highway.h"
#include "attention/cpu/simd-inl.h"
#include "formats/dither/dither.h"
#include "formats/dither/philox.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {

// ξ_c = formats::dither_from_bits(word c mod 4 of Philox(counter, c/4, kv_head, layer)), c < d: the
// counters are the SIMD lanes, four channels per lane.
void DitherRow(const formats::DitherStream& s, std::uint32_t counter, int d, float* xi, std::uint32_t* words) {
#if HWY_TARGET == HWY_SCALAR
  (void)words;
  formats::dither_values(s, counter, std::span<float>(xi, d));
#else
  using namespace formats::philox_detail;
  const hn::ScalableTag<std::uint32_t> du;
  const hn::Repartition<std::uint64_t, decltype(du)> du64;
  const hn::RebindToSigned<decltype(du)> di;
  const hn::Rebind<float, decltype(du)> df;
  constexpr std::size_t kL = hn::MaxLanes(du);
  // hi and lo words of a·m per lane, from the 64-bit products of the even and the odd lanes.
  const auto mul_hi_lo = [&](auto a, std::uint32_t m, auto& hi, auto& lo) {
    const auto mv = hn::Set(du, m);
    const auto even = hn::MulEven(a, mv);
    const auto odd = hn::MulEven(hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(du64, a))), mv);
    hi = hn::OddEven(hn::BitCast(du, odd), hn::BitCast(du, hn::ShiftRight<32>(even)));
    lo = hn::OddEven(hn::BitCast(du, hn::ShiftLeft<32>(odd)), hn::BitCast(du, even));
  };
  for (int j0 = 0; j0 < d / 4; j0 += static_cast<int>(kL)) {
    auto c0 = hn::Set(du, counter), c1 = hn::Iota(du, static_cast<std::uint32_t>(j0));
    auto c2 = hn::Set(du, s.kv_head), c3 = hn::Set(du, s.layer);
    std::uint32_t k0 = static_cast<std::uint32_t>(s.seed), k1 = static_cast<std::uint32_t>(s.seed >> 32);
    for (int round = 0; round < 10; ++round) {
      if (round > 0) k0 += kW0, k1 += kW1;
      decltype(c0) hi0, lo0, hi1, lo1;
      mul_hi_lo(c0, kM0, hi0, lo0);
      mul_hi_lo(c2, kM1, hi1, lo1);
      c0 = hn::Xor(hn::Xor(hi1, c1), hn::Set(du, k0));
      c1 = lo1;
      c2 = hn::Xor(hn::Xor(hi0, c3), hn::Set(du, k1));
      c3 = lo0;
    }
    hn::StoreInterleaved4(c0, c1, c2, c3, du, words + 4 * j0);
  }
  for (int c = 0; c < d; c += static_cast<int>(kL)) {
    const auto top = hn::BitCast(di, hn::ShiftRight<8>(hn::LoadU(du, words + c)));
    hn::StoreU(hn::MulAdd(hn::ConvertTo(df, top), hn::Set(df, 0x1p-24f), hn::Set(df, -0.5f)), df, xi + c);
  }
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_PHILOX_INL_H_
