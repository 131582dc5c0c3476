// Dithered codes below 8 bits (formats/dither/code_pack.h) unpacked to one int8 a code in SIMD
// (included per target after hwy/highway.h): a block of 32 codes is two 16-lane vectors, its low
// nibbles a mask and a shift, its high plane broadcast across the lanes and cut with per-lane
// masks. Bit for bit formats::unpack_codes, the scalar reference (CertifiedFast.PackedCodesUnpack...).
#if defined(WITCERT_KERNEL_CODES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_KERNEL_CODES_INL_H_
#undef WITCERT_KERNEL_CODES_INL_H_
#else
#define WITCERT_KERNEL_CODES_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "formats/dither/code_pack.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::kernel {
namespace HWY_NAMESPACE {
#if HWY_TARGET != HWY_SCALAR
namespace codes {

namespace hn = hwy::HWY_NAMESPACE;

template <int B>
HWY_INLINE void Block(const std::uint8_t* in, std::int8_t* out) {
  const hn::Full128<std::uint8_t> d;
  const hn::Full128<std::int8_t> di;
  const auto nib = hn::LoadU(d, in);
  auto u0 = hn::And(nib, hn::Set(d, 15));  // codes 0–15
  auto u1 = hn::ShiftRight<4>(nib);        // codes 16–31
  if constexpr (B == 5) {
    // Byte j of the plane (j < 4), bit k: code j + 4k. Broadcast to [p0 p1 p2 p3] × 4: lane i of
    // codes 0–15 wants bit i/4, of codes 16–31 bit 4 + i/4.
    std::uint32_t word;
    std::memcpy(&word, in + 16, 4);
    const auto plane = hn::BitCast(d, hn::Set(hn::Full128<std::uint32_t>(), word));
    alignas(16) static constexpr std::uint8_t kLow[16] = {1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8};
    alignas(16) static constexpr std::uint8_t kHigh[16] = {16, 16, 16, 16, 32, 32, 32, 32, 64, 64, 64, 64, 128, 128, 128, 128};
    const auto bit = [&](const std::uint8_t* mask) {
      return hn::And(hn::VecFromMask(d, hn::Ne(hn::And(plane, hn::Load(d, mask)), hn::Zero(d))), hn::Set(d, 16));
    };
    u0 = hn::Or(u0, bit(kLow));
    u1 = hn::Or(u1, bit(kHigh));
  }
  if constexpr (B == 6) {
    // Byte j of the plane (j < 8), bits 2k, 2k + 1: code j + 8k. Broadcast to [p0 … p7] × 2: codes
    // 0–7 take k = 0, 8–15 k = 1 (the upper half), 16–23 k = 2, 24–31 k = 3.
    std::uint64_t word;
    std::memcpy(&word, in + 16, 8);
    const auto plane = hn::BitCast(d, hn::Set(hn::Full128<std::uint64_t>(), word));
    const auto three = hn::Set(d, 3);
    const auto f0 = hn::And(plane, three), f1 = hn::And(hn::ShiftRight<2>(plane), three);
    const auto f2 = hn::And(hn::ShiftRight<4>(plane), three), f3 = hn::ShiftRight<6>(plane);
    u0 = hn::Or(u0, hn::ShiftLeft<4>(hn::ConcatUpperLower(d, f1, f0)));
    u1 = hn::Or(u1, hn::ShiftLeft<4>(hn::ConcatUpperLower(d, f3, f2)));
  }
  const auto offset = hn::Set(d, static_cast<std::uint8_t>(1 << (B - 1)));
  hn::StoreU(hn::BitCast(di, hn::Sub(u0, offset)), di, out);
  hn::StoreU(hn::BitCast(di, hn::Sub(u1, offset)), di, out + 16);
}

template <int B>
HWY_INLINE void Run(const std::uint8_t* run, std::size_t n, std::int8_t* out) {
  for (std::size_t i = 0; i < n; i += formats::kCodeBlock, run += 4 * B, out += formats::kCodeBlock) Block<B>(run, out);
}

}  // namespace codes
#endif

// Codes [0, n) of a run of `bits` bits (4, 5 or 6; n a multiple of 32) into out. The scalar target
// (no 16-lane vectors) takes the scalar reference itself.
HWY_INLINE void UnpackCodes(const std::uint8_t* run, int bits, std::size_t n, std::int8_t* out) {
#if HWY_TARGET == HWY_SCALAR
  formats::unpack_codes(run, bits, n, out);
#else
  switch (bits) {
    case 4: return codes::Run<4>(run, n, out);
    case 5: return codes::Run<5>(run, n, out);
    default: return codes::Run<6>(run, n, out);
  }
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::kernel
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_KERNEL_CODES_INL_H_
