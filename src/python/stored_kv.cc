#include "python/stored_kv.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "base/fp16.h"

namespace witcert::python {

namespace {

// fp8 with `mantissa` bits and exponent bias `bias`, decoded exactly; e4m3 (no infinity, 0x7F and
// 0xFF are NaN) and e5m2 (IEEE-like: exponent all ones is infinity or NaN).
float fp8(std::uint8_t b, int mantissa, int bias, bool ieee) {
  const int exp_bits = 7 - mantissa;
  const int e = (b >> mantissa) & ((1 << exp_bits) - 1), m = b & ((1 << mantissa) - 1);
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  if (ieee && e == (1 << exp_bits) - 1) return m ? std::numeric_limits<float>::quiet_NaN() : sign * HUGE_VALF;
  if (!ieee && e == (1 << exp_bits) - 1 && m == (1 << mantissa) - 1) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), 1 - bias - mantissa);
  return sign * std::ldexp(static_cast<float>((1 << mantissa) | m), e - bias - mantissa);
}

std::array<float, 256> table(int mantissa, int bias, bool ieee) {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[b] = fp8(static_cast<std::uint8_t>(b), mantissa, bias, ieee);
  return t;
}

const std::array<float, 256> kE4m3 = table(3, 7, false), kE5m2 = table(2, 15, true);

}  // namespace

StoredLayout stored_layout(const std::string& name) {
  if (name == "vec") return StoredLayout::vec;
  if (name == "amx") return StoredLayout::amx;
  throw std::invalid_argument("no reader for the cache layout '" + name + "' (known: vec, amx)");
}

StoredElement stored_element(const std::string& name) {
  if (name == "float32") return StoredElement::f32;
  if (name == "float16") return StoredElement::f16;
  if (name == "bfloat16") return StoredElement::bf16;
  if (name == "float8_e4m3fn") return StoredElement::e4m3;
  if (name == "float8_e5m2") return StoredElement::e5m2;
  throw std::invalid_argument("no reader for the element type '" + name +
                              "' (known: float32, float16, bfloat16, float8_e4m3fn, float8_e5m2)");
}

std::size_t element_bytes(StoredElement e) {
  switch (e) {
    case StoredElement::f32: return 4;
    case StoredElement::f16:
    case StoredElement::bf16: return 2;
    default: return 1;
  }
}

float stored_value(const std::uint8_t* p, StoredElement e) {
  switch (e) {
    case StoredElement::f32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case StoredElement::f16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return fp16_to_float(h);
    }
    case StoredElement::bf16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      const std::uint32_t bits = std::uint32_t{h} << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case StoredElement::e4m3: return kE4m3[*p];
    case StoredElement::e5m2: return kE5m2[*p];
  }
  return 0.0f;
}

void read_stored(const std::uint8_t* cache, const StoredShape& s, StoredLayout layout, StoredElement e,
                 std::int64_t slot, float k_scale, float v_scale, float* k, float* v) {
  const std::int64_t bs = s.block_size, d = s.head_dim, blk = slot / bs, off = slot % bs;
  const std::size_t eb = element_bytes(e);
  for (std::int64_t h = 0; h < s.kv_heads; ++h) {
    const std::uint8_t* keys = cache + static_cast<std::size_t>(((blk * s.kv_heads + h) * 2) * bs * d) * eb;
    const std::uint8_t* values = keys + static_cast<std::size_t>(bs * d) * eb;
    for (std::int64_t c = 0; c < d; ++c) {
      std::int64_t ki, vi;
      if (layout == StoredLayout::vec) {
        ki = c * bs + off;
        vi = off * d + c;
      } else {
        ki = (off / 16) * (16 * d) + (c / 2) * 32 + (off % 16) * 2 + c % 2;
        vi = (c / 16) * (bs * 16) + (off / 2) * 32 + (c % 16) * 2 + off % 2;
      }
      k[h * d + c] = stored_value(keys + ki * eb, e) * k_scale;
      v[h * d + c] = stored_value(values + vi * eb, e) * v_scale;
    }
  }
}

}  // namespace witcert::python
