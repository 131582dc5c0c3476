#include "formats/scheme_kit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace witcert::formats::kit {

void pack(std::span<const unsigned> fields, int bits, std::uint8_t* out) {
  std::memset(out, 0, packed_bytes(static_cast<int>(fields.size()), bits));
  for (std::size_t i = 0; i < fields.size(); ++i) {
    const std::size_t bit = i * bits;
    out[bit / 8] |= static_cast<std::uint8_t>(fields[i] << (bit % 8));
  }
}

unsigned unpack(const std::uint8_t* in, int i, int bits) {
  const std::size_t bit = static_cast<std::size_t>(i) * bits;
  return (in[bit / 8] >> (bit % 8)) & ((1u << bits) - 1);
}

void encode_symmetric(std::span<const double> v, int bits, std::uint8_t* out) {
  const int q_max = (1 << (bits - 1)) - 1;
  double amax = 0.0;
  bool finite = true;
  for (double x : v) {
    finite = finite && std::isfinite(x);
    amax = std::max(amax, std::fabs(x));
  }
  const f16 s16 = finite ? fp16_from_double(amax / q_max, Round::up) : kFp16PosInf;
  const double s = fp16_to_double(s16);
  const std::span<unsigned> fields = scratch<unsigned>(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    // s = 0 only for an all-zero record, which q = 0 reconstructs exactly. The clamp cannot bind
    // (|v/s| ≤ q_max up to a rounding of the quotient) but keeps the field in range regardless.
    const double q = finite && s > 0.0 ? std::clamp(std::nearbyint(v[i] / s), -double(q_max), double(q_max)) : 0.0;
    fields[i] = static_cast<unsigned>(static_cast<int>(q) + (1 << (bits - 1)));
  }
  store_f16(out, s16);
  pack(fields, bits, out + 2);
}

void decode_symmetric(const std::uint8_t* in, int bits, std::span<double> out) {
  const double s = fp16_to_double(load_f16(in));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const int q = static_cast<int>(unpack(in + 2, static_cast<int>(i), bits)) - (1 << (bits - 1));
    out[i] = s * q;
  }
}

void encode_asymmetric(std::span<const double> v, int bits, std::uint8_t* out, std::span<const std::uint8_t> skip) {
  const int q_max = (1 << bits) - 1;
  double lo = INFINITY, hi = -INFINITY;
  bool finite = true;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!skip.empty() && skip[i]) continue;
    finite = finite && std::isfinite(v[i]);
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
  }
  if (lo > hi) lo = hi = 0.0;  // every value skipped
  // lo rounded down and s rounded up keep (v − lo)/s within [0, q_max]: no code clips.
  const f16 lo16 = finite ? fp16_down(lo) : f16{0};
  const double lo_stored = fp16_to_double(lo16);
  const f16 s16 = finite ? fp16_from_double((hi - lo_stored) / q_max, Round::up) : kFp16PosInf;
  const double s = fp16_to_double(s16);
  const std::span<unsigned> fields = scratch<unsigned>(v.size());
  std::fill(fields.begin(), fields.end(), 0u);
  for (std::size_t i = 0; i < v.size(); ++i) {
    if ((!skip.empty() && skip[i]) || !finite || s == 0.0) continue;
    fields[i] = static_cast<unsigned>(std::clamp(std::nearbyint((v[i] - lo_stored) / s), 0.0, double(q_max)));
  }
  store_f16(out, s16);
  store_f16(out + 2, lo16);
  pack(fields, bits, out + 4);
}

void decode_asymmetric(const std::uint8_t* in, int bits, std::span<double> out) {
  const double s = fp16_to_double(load_f16(in));
  const double lo = fp16_to_double(load_f16(in + 2));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = lo + s * unpack(in + 4, static_cast<int>(i), bits);
}

void require(bool ok, std::string_view scheme, std::string_view requirement, int head_dim) {
  if (!ok)
    throw std::invalid_argument(std::string(scheme) + ": " + std::string(requirement) + ", got head_dim " +
                                std::to_string(head_dim));
}

}  // namespace witcert::formats::kit
