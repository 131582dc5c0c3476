// GGML tensor types: ids and block geometry as in the GGUF format, dequantization of the types
// GGUF models commonly use, and the reference quantizers of llama.cpp's KV-cache formats.
#pragma once

#include <cstddef>
#include <cstdint>

namespace witcert::formats {

// Type ids as stored in GGUF tensor infos.
enum class GgmlType : std::uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ4_NL = 20,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  BF16 = 30,
};

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;
  std::int64_t block_size;  // elements per block
  std::size_t block_bytes;  // bytes per block
  bool dequantizable;       // dequantize_row supports it
};

// The geometry of a known type id, or nullptr for an id this build does not know.
const GgmlTypeInfo* ggml_type_info(std::uint32_t id);
inline const GgmlTypeInfo* ggml_type_info(GgmlType t) { return ggml_type_info(static_cast<std::uint32_t>(t)); }

// Bytes of a row of n elements; throws std::invalid_argument if n is not a whole number of blocks.
std::size_t ggml_row_bytes(GgmlType t, std::int64_t n);

// src holds n elements of type t (n a multiple of the block size); writes n floats, bit-identical
// to llama.cpp's dequantize_row_* (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K,
// Q5_K, Q6_K). Throws std::invalid_argument for a type without dequantization or a partial block.
void dequantize_row(GgmlType t, const void* src, float* dst, std::int64_t n);

// llama.cpp's reference quantizers (quantize_row_*_ref; IQ4_NL without importance weights),
// bit-exact with its block layouts: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL. The
// block types need finite inputs (llama.cpp's codes for NaN or ±inf are undefined too). Throws
// std::invalid_argument for other types or a partial block.
void quantize_row(GgmlType t, const float* src, void* dst, std::int64_t n);

// Q4_K and Q5_K pack eight 6-bit (scale, min) pairs into 12 bytes: pairs 0-3 in the low 6 bits of
// bytes 0-3 (scale) and 4-7 (min); pairs 4-7 take their low 4 bits from bytes 8-11 and their top 2
// bits from the spare top bits of bytes 0-7. Pair j of the bytes at s, as llama.cpp's
// get_scale_min_k4; the dequantizer and the matmul's decoders both read it.
inline void q4_k_scale_min(int j, const std::uint8_t* s, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The IQ4_NL code book (llama.cpp's kvalues_iq4nl), sorted ascending.
inline constexpr std::int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                 1,    13,   25,  38,  53,  69,  89,  113};

}  // namespace witcert::formats
