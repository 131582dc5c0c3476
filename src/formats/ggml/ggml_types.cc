#include "formats/ggml/ggml_types.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "base/fp16.h"

namespace witcert::formats {

// GGUF stores every multi-byte field little-endian; blocks are read and written in place.
static_assert(std::endian::native == std::endian::little, "GGML block layouts assume a little-endian host");

namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::F32, "F32", 1, 4, true},        {GgmlType::F16, "F16", 1, 2, true},
    {GgmlType::Q4_0, "Q4_0", 32, 18, true},    {GgmlType::Q4_1, "Q4_1", 32, 20, true},
    {GgmlType::Q5_0, "Q5_0", 32, 22, true},    {GgmlType::Q5_1, "Q5_1", 32, 24, true},
    {GgmlType::Q8_0, "Q8_0", 32, 34, true},    {GgmlType::Q8_1, "Q8_1", 32, 36, false},
    {GgmlType::Q2_K, "Q2_K", 256, 84, false},  {GgmlType::Q3_K, "Q3_K", 256, 110, false},
    {GgmlType::Q4_K, "Q4_K", 256, 144, true},  {GgmlType::Q5_K, "Q5_K", 256, 176, true},
    {GgmlType::Q6_K, "Q6_K", 256, 210, true},  {GgmlType::Q8_K, "Q8_K", 256, 292, false},
    {GgmlType::IQ4_NL, "IQ4_NL", 32, 18, true}, {GgmlType::I8, "I8", 1, 1, false},
    {GgmlType::I16, "I16", 1, 2, false},       {GgmlType::I32, "I32", 1, 4, false},
    {GgmlType::I64, "I64", 1, 8, false},       {GgmlType::F64, "F64", 1, 8, false},
    {GgmlType::BF16, "BF16", 1, 2, true},
};

using Byte = std::uint8_t;

float get_f16(const Byte* p) {
  f16 h;
  std::memcpy(&h, p, sizeof h);
  return fp16_to_float(h);
}

void put_f16(Byte* p, float v) {
  const f16 h = fp16_from_double(v);  // round to nearest even, as ggml's FP32 -> FP16
  std::memcpy(p, &h, sizeof h);
}

std::uint32_t get_u32(const Byte* p) {
  std::uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// ---- Dequantization, one block each. The float expressions keep ggml's operation order so the
// results are bit-identical (this file is compiled without FP contraction).

void dequant_q4_0(const Byte* b, float* y) {  // d, qs[16]
  const float d = get_f16(b);
  const Byte* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void dequant_q4_1(const Byte* b, float* y) {  // d, m, qs[16]
  const float d = get_f16(b), m = get_f16(b + 2);
  const Byte* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// The fifth bit of element j is bit j of qh.
void dequant_q5_0(const Byte* b, float* y) {  // d, qh[4], qs[16]
  const float d = get_f16(b);
  const std::uint32_t qh = get_u32(b + 2);
  const Byte* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
    y[j] = static_cast<float>(lo - 16) * d;
    y[j + 16] = static_cast<float>(hi - 16) * d;
  }
}

void dequant_q5_1(const Byte* b, float* y) {  // d, m, qh[4], qs[16]
  const float d = get_f16(b), m = get_f16(b + 2);
  const std::uint32_t qh = get_u32(b + 4);
  const Byte* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
    y[j] = static_cast<float>(lo) * d + m;
    y[j + 16] = static_cast<float>(hi) * d + m;
  }
}

void dequant_q8_0(const Byte* b, float* y) {  // d, qs[32] (int8)
  const float d = get_f16(b);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<std::int8_t>(b[2 + j])) * d;
}

void dequant_iq4_nl(const Byte* b, float* y) {  // d, qs[16] (indices into the code book)
  const float d = get_f16(b);
  const Byte* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(kIq4nlValues[qs[j] & 0x0F]);
    y[j + 16] = d * static_cast<float>(kIq4nlValues[qs[j] >> 4]);
  }
}

// Q4_K (d, dmin, scales[12], qs[128]) and Q5_K (the same with qh[32] before qs). Each 64 elements
// share 32 qs bytes: low nibbles are the first sub-block of 32, high the second; Q5_K adds a fifth
// bit per element, bit 2·chunk (even sub-block) or 2·chunk + 1 (odd) of qh[l].
template <bool kFifth>
void dequant_k4(const Byte* b, float* y) {
  const float d = get_f16(b), dmin = get_f16(b + 2);
  const Byte* scales = b + 4;
  const Byte* qh = b + 16;
  const Byte* qs = b + (kFifth ? 48 : 16);
  for (int chunk = 0; chunk < 4; ++chunk, qs += 32, y += 64) {
    int sc, m;
    q4_k_scale_min(2 * chunk, scales, &sc, &m);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
    q4_k_scale_min(2 * chunk + 1, scales, &sc, &m);
    const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) {
      const int lo = (qs[l] & 0x0F) + (kFifth ? ((qh[l] >> (2 * chunk)) & 1) * 16 : 0);
      const int hi = (qs[l] >> 4) + (kFifth ? ((qh[l] >> (2 * chunk + 1)) & 1) * 16 : 0);
      y[l] = d1 * static_cast<float>(lo) - m1;
      y[l + 32] = d2 * static_cast<float>(hi) - m2;
    }
  }
}

void dequant_q6_k(const Byte* b, float* y) {  // ql[128], qh[64], scales[16] (int8), d
  const Byte* ql = b;
  const Byte* qh = b + 128;
  const std::int8_t* sc = reinterpret_cast<const std::int8_t*>(b + 192);
  const float d = get_f16(b + 208);
  // Each 128 elements use 64 ql bytes (two nibbles) and 32 qh bytes (four 2-bit fields); element
  // l + 32i of the 128 takes field i; its 16-element sub-block selects the scale.
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
  }
}

void dequant_f16(const Byte* b, float* y) { *y = get_f16(b); }

void dequant_bf16(const Byte* b, float* y) {
  std::uint16_t h;
  std::memcpy(&h, b, sizeof h);
  *y = std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

void dequant_f32(const Byte* b, float* y) { std::memcpy(y, b, sizeof(float)); }

// ---- llama.cpp's reference quantizers (quantize_row_*_ref), one block each.

// The block's value of largest magnitude, sign kept; the first one wins a tie.
float signed_absmax(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < n; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

void min_max(const float* x, int n, float* min, float* max) {
  *min = FLT_MAX;
  *max = -FLT_MAX;
  for (int j = 0; j < n; ++j) {
    if (x[j] < *min) *min = x[j];
    if (x[j] > *max) *max = x[j];
  }
}

// Symmetric 4-bit: the extreme value maps to code 0 (q = -8), so d carries its sign.
void quant_q4_0(const float* x, Byte* b) {
  const float d = signed_absmax(x, 32) / -8;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_f16(b, d);
  for (int j = 0; j < 16; ++j) {
    const int lo = std::min(15, static_cast<int>(x[j] * id + 8.5f));  // truncation of a value > 0
    const int hi = std::min(15, static_cast<int>(x[j + 16] * id + 8.5f));
    b[2 + j] = static_cast<Byte>(lo | (hi << 4));
  }
}

void quant_q4_1(const float* x, Byte* b) {
  float min, max;
  min_max(x, 32, &min, &max);
  const float d = (max - min) / 15;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_f16(b, d);
  put_f16(b + 2, min);
  for (int j = 0; j < 16; ++j) {
    const int lo = std::min(15, static_cast<int>((x[j] - min) * id + 0.5f));
    const int hi = std::min(15, static_cast<int>((x[j + 16] - min) * id + 0.5f));
    b[4 + j] = static_cast<Byte>(lo | (hi << 4));
  }
}

void pack_q5(const int* q, Byte* qh_out, Byte* qs) {
  std::uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    qs[j] = static_cast<Byte>((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
    qh |= static_cast<std::uint32_t>((q[j] >> 4) & 1) << j;
    qh |= static_cast<std::uint32_t>((q[j + 16] >> 4) & 1) << (j + 16);
  }
  std::memcpy(qh_out, &qh, sizeof qh);
}

void quant_q5_0(const float* x, Byte* b) {
  const float d = signed_absmax(x, 32) / -16;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_f16(b, d);
  int q[32];
  for (int j = 0; j < 32; ++j) q[j] = std::min(31, static_cast<int>(x[j] * id + 16.5f));
  pack_q5(q, b + 2, b + 6);
}

void quant_q5_1(const float* x, Byte* b) {
  float min, max;
  min_max(x, 32, &min, &max);
  const float d = (max - min) / 31;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_f16(b, d);
  put_f16(b + 2, min);
  int q[32];
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int>((x[j] - min) * id + 0.5f);  // ≤ 31 (no clamp in ggml)
  pack_q5(q, b + 4, b + 8);
}

void quant_q8_0(const float* x, Byte* b) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_f16(b, d);
  for (int j = 0; j < 32; ++j)
    b[2 + j] = static_cast<Byte>(static_cast<std::int8_t>(std::round(x[j] * id)));  // ties away from 0
}

// The code whose value is nearest x (ties to the larger): the midpoints are compared doubled, so
// both sides are exact.
int nearest_iq4nl(float x) {
  const float x2 = x + x;
  int idx = 0;
  for (int step = 8; step > 0; step >>= 1) {
    const int j = idx + step;
    if (x2 >= static_cast<float>(kIq4nlValues[j - 1] + kIq4nlValues[j])) idx = j;
  }
  return idx;
}

// The reference path of quantize_row_iq4_nl_impl (ntry = -1, no importance weights): codes from
// the scale that maps the extreme value to -127, then the weighted (w = x²) least-squares scale
// for those codes; the codes are not re-chosen for the fitted scale.
void quant_iq4_nl(const float* x, Byte* b) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) {
      amax = ax;
      max = x[j];
    }
  }
  int L[32] = {};
  float d = 0.0f;
  if (amax >= 1e-15f) {  // ggml's GROUP_MAX_EPS: a smaller block is stored as zero
    const float id = 1.0f / (max / kIq4nlValues[0]);
    float sumqx = 0.0f, sumq2 = 0.0f;
    for (int j = 0; j < 32; ++j) {
      L[j] = nearest_iq4nl(id * x[j]);
      const float q = kIq4nlValues[L[j]];
      const float w = x[j] * x[j];
      sumqx += w * q * x[j];
      sumq2 += w * q * q;
    }
    d = sumq2 > 0.0f ? sumqx / sumq2 : 0.0f;
  }
  put_f16(b, d);
  for (int j = 0; j < 16; ++j) b[2 + j] = static_cast<Byte>(L[j] | (L[j + 16] << 4));
}

void quant_f16(const float* x, Byte* b) { put_f16(b, *x); }

// ggml_compute_fp32_to_bf16: round to nearest even; a NaN stays a (quiet) NaN.
void quant_bf16(const float* x, Byte* b) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(*x);
  std::uint16_t h;
  if ((u & 0x7FFFFFFF) > 0x7F800000)
    h = static_cast<std::uint16_t>((u >> 16) | 64);
  else
    h = static_cast<std::uint16_t>((u + (0x7FFF + ((u >> 16) & 1))) >> 16);
  std::memcpy(b, &h, sizeof h);
}

void quant_f32(const float* x, Byte* b) { std::memcpy(b, x, sizeof(float)); }

using DequantBlock = void (*)(const Byte*, float*);
using QuantBlock = void (*)(const float*, Byte*);

DequantBlock dequantizer(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return dequant_f32;
    case GgmlType::F16: return dequant_f16;
    case GgmlType::BF16: return dequant_bf16;
    case GgmlType::Q4_0: return dequant_q4_0;
    case GgmlType::Q4_1: return dequant_q4_1;
    case GgmlType::Q5_0: return dequant_q5_0;
    case GgmlType::Q5_1: return dequant_q5_1;
    case GgmlType::Q8_0: return dequant_q8_0;
    case GgmlType::IQ4_NL: return dequant_iq4_nl;
    case GgmlType::Q4_K: return dequant_k4<false>;
    case GgmlType::Q5_K: return dequant_k4<true>;
    case GgmlType::Q6_K: return dequant_q6_k;
    default: return nullptr;
  }
}

QuantBlock quantizer(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return quant_f32;
    case GgmlType::F16: return quant_f16;
    case GgmlType::BF16: return quant_bf16;
    case GgmlType::Q4_0: return quant_q4_0;
    case GgmlType::Q4_1: return quant_q4_1;
    case GgmlType::Q5_0: return quant_q5_0;
    case GgmlType::Q5_1: return quant_q5_1;
    case GgmlType::Q8_0: return quant_q8_0;
    case GgmlType::IQ4_NL: return quant_iq4_nl;
    default: return nullptr;
  }
}

std::string type_name(GgmlType t) {
  const GgmlTypeInfo* info = ggml_type_info(t);
  return info ? info->name : "type id " + std::to_string(static_cast<std::uint32_t>(t));
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(std::uint32_t id) {
  for (const GgmlTypeInfo& info : kTypes)
    if (static_cast<std::uint32_t>(info.type) == id) return &info;
  return nullptr;
}

std::size_t ggml_row_bytes(GgmlType t, std::int64_t n) {
  const GgmlTypeInfo* info = ggml_type_info(t);
  if (!info) throw std::invalid_argument("unknown tensor type id " + std::to_string(static_cast<std::uint32_t>(t)));
  if (n < 0 || n % info->block_size != 0)
    throw std::invalid_argument(std::string(info->name) + " rows must be a multiple of " +
                                std::to_string(info->block_size) + " elements, got " + std::to_string(n));
  return static_cast<std::size_t>(n / info->block_size) * info->block_bytes;
}

void dequantize_row(GgmlType t, const void* src, float* dst, std::int64_t n) {
  const DequantBlock f = dequantizer(t);
  if (!f) throw std::invalid_argument("no dequantization for " + type_name(t));
  const GgmlTypeInfo& info = *ggml_type_info(t);
  const Byte* b = static_cast<const Byte*>(src);
  const std::int64_t blocks = static_cast<std::int64_t>(ggml_row_bytes(t, n) / info.block_bytes);
  for (std::int64_t i = 0; i < blocks; ++i) f(b + i * info.block_bytes, dst + i * info.block_size);
}

void quantize_row(GgmlType t, const float* src, void* dst, std::int64_t n) {
  const QuantBlock f = quantizer(t);
  if (!f) throw std::invalid_argument("no reference quantizer for " + type_name(t));
  const GgmlTypeInfo& info = *ggml_type_info(t);
  Byte* b = static_cast<Byte*>(dst);
  const std::int64_t blocks = static_cast<std::int64_t>(ggml_row_bytes(t, n) / info.block_bytes);
  for (std::int64_t i = 0; i < blocks; ++i) f(src + i * info.block_size, b + i * info.block_bytes);
}

}  // namespace witcert::formats
