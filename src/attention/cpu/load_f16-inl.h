// fp16 → float in SIMD, exact for every input, for the attention kernels (included per target
// after hwy/highway.h, as Highway's -inl.h headers are).
#if defined(WITCERT_ATTN_LOAD_F16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WITCERT_ATTN_LOAD_F16_INL_H_
#undef WITCERT_ATTN_LOAD_F16_INL_H_
#else
#define WITCERT_ATTN_LOAD_F16_INL_H_
#endif

#include <cstdint>

#include "base/fp16.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace witcert::attention {
namespace HWY_NAMESPACE {

// Lanes(df) fp16 values from p as floats. Highway's conversion on targets without F16C maps inf and
// NaN to finite values, which would hide them from the meter, so those targets convert the bits
// here: normal and subnormal values are the shifted bits times 2^112, inf and NaN keep an all-ones
// exponent.
template <class D>
HWY_INLINE hwy::HWY_NAMESPACE::Vec<D> LoadF16(D df, const f16* p) {
  namespace hn = hwy::HWY_NAMESPACE;
#if HWY_TARGET >= HWY_SSE4
  const hn::RebindToSigned<D> di;
  const hn::Rebind<std::uint16_t, D> du16;
  const auto h = hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<D>(), hn::LoadU(du16, p)));
  const auto em = hn::And(h, hn::Set(di, 0x7FFF));
  const auto sign = hn::BitCast(df, hn::ShiftLeft<16>(hn::AndNot(hn::Set(di, 0x7FFF), h)));
  const auto shifted = hn::ShiftLeft<13>(em);
  const auto finite = hn::Mul(hn::BitCast(df, shifted), hn::Set(df, 0x1p112f));
  const auto special = hn::BitCast(df, hn::Or(shifted, hn::Set(di, 0x7F800000)));
  return hn::Or(hn::IfThenElse(hn::RebindMask(df, hn::Gt(em, hn::Set(di, 0x7BFF))), special, finite), sign);
#else
  return hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::float16_t, D>(), reinterpret_cast<const hwy::float16_t*>(p)));
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace witcert::attention
HWY_AFTER_NAMESPACE();

#endif  // WITCERT_ATTN_LOAD_F16_INL_H_
