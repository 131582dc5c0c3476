#include "formats/ggml/ggml_types.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace witcert::formats {
namespace {

using Bytes = std::vector<std::uint8_t>;

// llama.cpp's IQ4_NL code book, written out again so the tests do not read the code under test.
constexpr int kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

std::vector<float> dequantize(GgmlType t, const Bytes& b, std::int64_t n) {
  std::vector<float> y(n);
  dequantize_row(t, b.data(), y.data(), n);
  return y;
}

Bytes quantize(GgmlType t, const std::vector<float>& x) {
  Bytes b(ggml_row_bytes(t, static_cast<std::int64_t>(x.size())));
  quantize_row(t, x.data(), b.data(), static_cast<std::int64_t>(x.size()));
  return b;
}

void put16(Bytes& b, std::size_t at, std::uint16_t v) {
  b[at] = static_cast<std::uint8_t>(v & 0xFF);
  b[at + 1] = static_cast<std::uint8_t>(v >> 8);
}

// Expects bit-identical floats (so -0 and +0 differ, as they do in ggml).
void expect_floats(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i]))
        << "element " << i << ": got " << got[i] << ", want " << want[i];
}

// ---- Dequantization of hand-built blocks; the expected values are worked out here from the
// block layout (fp16 scales chosen exactly representable so every product is exact).

TEST(GgmlDequant, F32F16BF16) {
  Bytes f32(8);
  const float v[2] = {1.5f, -0.1f};
  std::memcpy(f32.data(), v, 8);
  expect_floats(dequantize(GgmlType::F32, f32, 2), {1.5f, -0.1f});

  Bytes f16(14);
  const std::uint16_t h[7] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x3555, 0x8000, 0x7C00};
  for (int i = 0; i < 7; ++i) put16(f16, 2 * i, h[i]);
  expect_floats(dequantize(GgmlType::F16, f16, 7),
                {1.0f, -2.0f, 0x1p-24f, 65504.0f, 0.333251953125f, -0.0f, std::numeric_limits<float>::infinity()});
  put16(f16, 0, 0x7E00);
  EXPECT_TRUE(std::isnan(dequantize(GgmlType::F16, f16, 1)[0]));

  Bytes bf16(6);
  put16(bf16, 0, 0x3F80);
  put16(bf16, 2, 0xC0A0);
  put16(bf16, 4, 0x3EAB);  // 0x3EAB0000 = 0.333984375
  expect_floats(dequantize(GgmlType::BF16, bf16, 3), {1.0f, -5.0f, 0.333984375f});
}

// A block of 32 with qs[j] = j | (15 − j) << 4: element j gets j, element j + 16 gets 15 − j.
Bytes nibble_block(std::size_t header_bytes) {
  Bytes b(header_bytes + 16);
  for (int j = 0; j < 16; ++j) b[header_bytes + j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
  return b;
}

TEST(GgmlDequant, Q4_0) {
  Bytes b = nibble_block(2);
  put16(b, 0, 0x3800);  // d = 0.5
  std::vector<float> want(32);
  for (int j = 0; j < 16; ++j) {
    want[j] = (j - 8) * 0.5f;
    want[j + 16] = (7 - j) * 0.5f;
  }
  expect_floats(dequantize(GgmlType::Q4_0, b, 32), want);
}

TEST(GgmlDequant, Q4_1) {
  Bytes b = nibble_block(4);
  put16(b, 0, 0x3400);  // d = 0.25
  put16(b, 2, 0xBC00);  // m = -1
  std::vector<float> want(32);
  for (int j = 0; j < 16; ++j) {
    want[j] = j * 0.25f - 1.0f;
    want[j + 16] = (15 - j) * 0.25f - 1.0f;
  }
  expect_floats(dequantize(GgmlType::Q4_1, b, 32), want);
}

TEST(GgmlDequant, Q5_0) {
  Bytes b = nibble_block(6);
  put16(b, 0, 0x4000);  // d = 2
  // qh = 0xAAAA5555 (little-endian): bit k is element k's fifth bit, so elements 0, 2, ..., 14
  // and 17, 19, ..., 31 have it.
  b[2] = 0x55, b[3] = 0x55, b[4] = 0xAA, b[5] = 0xAA;
  std::vector<float> want(32);
  for (int j = 0; j < 16; ++j) {
    want[j] = ((j % 2 == 0 ? 16 : 0) + j - 16) * 2.0f;
    want[j + 16] = ((j % 2 == 1 ? 16 : 0) + 15 - j - 16) * 2.0f;
  }
  expect_floats(dequantize(GgmlType::Q5_0, b, 32), want);
}

TEST(GgmlDequant, Q5_1) {
  Bytes b = nibble_block(8);
  put16(b, 0, 0x3800);  // d = 0.5
  put16(b, 2, 0x4200);  // m = 3
  b[4] = 0xFF, b[5] = 0xFF, b[6] = 0x00, b[7] = 0x00;  // fifth bit on elements 0..15
  std::vector<float> want(32);
  for (int j = 0; j < 16; ++j) {
    want[j] = (j + 16) * 0.5f + 3.0f;
    want[j + 16] = (15 - j) * 0.5f + 3.0f;
  }
  expect_floats(dequantize(GgmlType::Q5_1, b, 32), want);
}

TEST(GgmlDequant, Q8_0) {
  Bytes b(34);
  put16(b, 0, 0xB400);  // d = -0.25
  std::vector<float> want(32);
  for (int j = 0; j < 32; ++j) {
    const int q = 8 * j - 128;  // -128, -120, ..., 120
    b[2 + j] = static_cast<std::uint8_t>(q & 0xFF);
    want[j] = q * -0.25f;
  }
  expect_floats(dequantize(GgmlType::Q8_0, b, 32), want);
}

TEST(GgmlDequant, IQ4_NL) {
  Bytes b = nibble_block(2);
  put16(b, 0, 0x3A00);  // d = 0.75
  std::vector<float> want(32);
  for (int j = 0; j < 16; ++j) {
    want[j] = 0.75f * kIq4nl[j];
    want[j + 16] = 0.75f * kIq4nl[15 - j];
  }
  expect_floats(dequantize(GgmlType::IQ4_NL, b, 32), want);
}

// Q4_K's and Q5_K's scales of the tests: 6-bit values above 15 in sub-blocks 4..7 exercise the
// split storage of their top two bits.
constexpr int kK4Scales[8] = {1, 2, 3, 63, 17, 33, 48, 5};
constexpr int kK4Mins[8] = {0, 1, 62, 7, 20, 0, 63, 9};

// A zeroed block of `bytes` with d = 1, dmin = 0.5 and the scales above packed.
Bytes k4_block(std::size_t bytes) {
  const int* sc = kK4Scales;
  const int* mn = kK4Mins;
  Bytes b(bytes);
  put16(b, 0, 0x3C00);  // d = 1
  put16(b, 2, 0x3800);  // dmin = 0.5
  for (int i = 0; i < 4; ++i) {
    b[4 + i] = static_cast<std::uint8_t>(sc[i] | ((sc[i + 4] >> 4) << 6));
    b[8 + i] = static_cast<std::uint8_t>(mn[i] | ((mn[i + 4] >> 4) << 6));
    b[12 + i] = static_cast<std::uint8_t>((sc[i + 4] & 15) | ((mn[i + 4] & 15) << 4));
  }
  return b;
}

TEST(GgmlDequant, Q4_K) {
  // Super-block of 256 = 8 sub-blocks of 32, each with a 6-bit scale and min; 6-bit values above
  // 15 in sub-blocks 4..7 exercise the split storage of their top two bits.
  Bytes b = k4_block(144);
  const int* sc = kK4Scales;
  const int* mn = kK4Mins;
  // 32 bytes per 64 elements: the low nibble of byte l is element l of the even sub-block, the
  // high nibble element l of the odd one.
  std::vector<float> want(256);
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const int lo = l % 16, hi = (7 * l) % 16;
      b[16 + 32 * c + l] = static_cast<std::uint8_t>(lo | (hi << 4));
      want[64 * c + l] = static_cast<float>(sc[2 * c] * lo) - 0.5f * mn[2 * c];
      want[64 * c + 32 + l] = static_cast<float>(sc[2 * c + 1] * hi) - 0.5f * mn[2 * c + 1];
    }
  }
  expect_floats(dequantize(GgmlType::Q4_K, b, 256), want);
}

TEST(GgmlDequant, Q5_K) {
  // Q4_K's scales and nibbles, plus a fifth bit: bit 2c (even sub-block) or 2c + 1 (odd) of qh[l].
  Bytes b = k4_block(176);
  const int* sc = kK4Scales;
  const int* mn = kK4Mins;
  std::vector<float> want(256);
  for (int l = 0; l < 32; ++l) b[16 + l] = static_cast<std::uint8_t>((37 * l + 11) & 0xFF);
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const int lo = l % 16, hi = (7 * l) % 16;
      b[48 + 32 * c + l] = static_cast<std::uint8_t>(lo | (hi << 4));
      const int lo5 = lo + 16 * ((b[16 + l] >> (2 * c)) & 1), hi5 = hi + 16 * ((b[16 + l] >> (2 * c + 1)) & 1);
      want[64 * c + l] = static_cast<float>(sc[2 * c] * lo5) - 0.5f * mn[2 * c];
      want[64 * c + 32 + l] = static_cast<float>(sc[2 * c + 1] * hi5) - 0.5f * mn[2 * c + 1];
    }
  }
  expect_floats(dequantize(GgmlType::Q5_K, b, 256), want);
}

TEST(GgmlDequant, Q6_K) {
  // Element i has the 6-bit code q(i) = (5i + 3) mod 64 and the int8 scale of sub-block i / 16.
  const int scale[16] = {1, -1, 2, -2, 127, -128, 3, 0, 5, 7, -9, 11, 64, -64, 13, 1};
  Bytes b(210);
  std::vector<float> want(256);
  for (int i = 0; i < 16; ++i) b[192 + i] = static_cast<std::uint8_t>(scale[i] & 0xFF);
  put16(b, 208, 0x3800);  // d = 0.5
  for (int i = 0; i < 256; ++i) {
    const int q = (5 * i + 3) % 64;
    // Within each half of 128, element 32k + l (k = 0..3) stores its low nibble in ql byte
    // 64·half + l + 32·(k mod 2) (high nibble when k ≥ 2) and its top two bits in bits 2k, 2k+1
    // of qh byte 32·half + l.
    const int half = i / 128, k = (i % 128) / 32, l = i % 32;
    const int ql = 64 * half + l + 32 * (k % 2);
    b[ql] |= static_cast<std::uint8_t>((q & 15) << (k >= 2 ? 4 : 0));
    b[128 + 32 * half + l] |= static_cast<std::uint8_t>((q >> 4) << (2 * k));
    want[i] = 0.5f * scale[i / 16] * (q - 32);
  }
  expect_floats(dequantize(GgmlType::Q6_K, b, 256), want);
}

// ---- Known answers produced outside this code base: the tables below are the output of
// `python3 scripts/ggml_kats.py` (gguf 0.19.0, numpy 2.4.6): gguf.quants' numpy ports of
// llama.cpp's reference (de)quantizers, numpy's fp16 cast, and for IQ4_NL's quantizer (absent
// from gguf) a float32 transcription of quantize_row_iq4_nl_ref in the script. The inputs are
// regenerated here bit for bit.

std::uint32_t lcg_next(std::uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  return state;
}

std::vector<float> kat_row() {
  std::uint32_t s = 1;
  std::vector<float> x;
  for (int i = 0; i < 64; ++i) {
    const std::int32_t v = static_cast<std::int32_t>(lcg_next(s) >> 8) - (1 << 23);
    x.push_back(std::ldexp(static_cast<float>(v), -22));
  }
  for (int i = 32; i < 64; ++i) x[i] = std::ldexp(x[i], -12);
  x[32 + 5] = 3.0f;
  x.insert(x.end(), 32, 0.0f);
  x.insert(x.end(), 32, 0.75f);
  for (int j = 0; j < 32; ++j) x.push_back(static_cast<float>(j - 16));
  return x;
}

std::vector<float> special_row() {
  const float inf = std::numeric_limits<float>::infinity();
  return {1 + 0x1p-11f, 1 + 3 * 0x1p-11f, 65504.0f, 65519.0f, 65520.0f, 1e-8f, 0x1p-24f, 3 * 0x1p-26f,
          0x1p-25f,     -0.0f,            inf,      -inf,     1e10f,    -1.5f, 1 + 0x1p-8f, 1 + 3 * 0x1p-8f};
}

Bytes random_blocks(GgmlType t, int blocks, std::uint32_t seed) {
  const GgmlTypeInfo& info = *ggml_type_info(t);
  Bytes raw(blocks * info.block_bytes);
  for (std::uint8_t& byte : raw) byte = static_cast<std::uint8_t>(lcg_next(seed) >> 24);
  std::vector<std::size_t> scale_fields;
  switch (t) {
    case GgmlType::Q4_1: case GgmlType::Q5_1: case GgmlType::Q4_K: case GgmlType::Q5_K: scale_fields = {0, 2}; break;
    case GgmlType::Q6_K: scale_fields = {208}; break;
    case GgmlType::F16: case GgmlType::BF16: break;
    default: scale_fields = {0};
  }
  for (int i = 0; i < blocks; ++i) {
    for (std::size_t off : scale_fields) {
      std::uint8_t* p = &raw[i * info.block_bytes + off];
      const unsigned r = p[0] | (p[1] << 8);
      const unsigned h = (r & 0x8000) | (0x2000 + (r & 0x0FFF));  // finite, |scale| in [2^-7, 2^-3)
      p[0] = static_cast<std::uint8_t>(h & 0xFF), p[1] = static_cast<std::uint8_t>(h >> 8);
    }
  }
  if (t == GgmlType::F16 || t == GgmlType::BF16) {  // clear an all-ones exponent: no NaN, no infinity
    const unsigned exponent = t == GgmlType::F16 ? 0x7C00 : 0x7F80;
    for (std::size_t i = 0; i < raw.size(); i += 2)
      if (((raw[i] | (raw[i + 1] << 8)) & exponent) == exponent) raw[i + 1] &= 0xBF;
  }
  return raw;
}

Bytes from_hex(const std::string& hex) {
  Bytes b(hex.size() / 2);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  return b;
}

std::uint64_t fnv1a64(const std::vector<float>& y) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (float v : y) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(v);
    for (int k = 0; k < 4; ++k) h = (h ^ ((u >> (8 * k)) & 0xFF)) * 0x100000001B3ull;
  }
  return h;
}

struct QuantKat {
  GgmlType type;
  const char* hex;
};

struct DequantKat {
  GgmlType type;
  int blocks;
  std::uint32_t seed;
  std::uint64_t fnv;
  struct Sample {
    int index;
    std::uint32_t bits;
  } samples[8];
};

// quantize_row(t, kat_row()): gguf.quants.quantize, IQ4_NL from iq4_nl_block() here.
const QuantKat kQuantKats[] = {
    {GgmlType::Q4_0,
     "bc33e456b89b31161d5920ba94674acef43f00b688888888888088888888888888888888008088888888888888888888"
     "88888888888800ae000000000000000000000000000000000040809191a2a2b3b3c4c4d5d5e6e6f7f7f8"},
    {GgmlType::Q4_1,
     "1d34bcbfd355a88b31151c5820ba946649bde33f6732b18f00000000000f000000000000000000000000000000000000"
     "0000000000000000000000000000003a00000000000000000000000000000000224000cc80809191a2a2b3b3c4c4d5d5"
     "e6e6f7f7"},
    {GgmlType::Q5_0,
     "bc2fccb20d66c7ac6017713c29a2407538cd838be75f00b2dfffffff000000000000000000000000000000000080ffff"
     "ffff0000000000000000000000000000000000aa0000000000000000000000000000000000000000003c0000ffff0011"
     "2233445566778899aabbccddeeff"},
    {GgmlType::Q5_1,
     "f72fbcbfccb20d66b7ab5016613b28a1406428cd828ad75f322eb18f2000000000000000000f00000000000000000000"
     "0000000000000000000000000000000000000000000000000000003a0000000000000000000000000000000000000000"
     "003c00cc0000ffff00112233445566778899aabbccddeeff"},
    {GgmlType::Q8_0,
     "cc23bbde01368ade480f8125beec1859ba7e5fd33008b5988fd09f3616e0c24271ab0c2600000000007f000000000000"
     "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "0000000000000c1e7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f083081899199a1a9"
     "b1b9c0c8d0d8e0e8f0f8000810182028303840474f575f676f77"},
    {GgmlType::IQ4_NL,
     "e023e345c89c20151d4910cba3563adef32f0ca688888888888088888888888888888888000000000000000000000000"
     "0000000000000c9e00000000000000000000000000000000fa2f809091a1b1b2c2c3d3d4e4e5e5f6f7f7"},
    {GgmlType::F16,
     "37bc2fb858248e3a31bf2db8653c3133bcbf7538fcbbf8b4ce35643d3dbcb23fc63d8ab9d83907308cbc54bedfbeccb9"
     "ecbda23a4e35b9b796bb043ce43e2abd4f89bb0f218713032b820042000ec40a530f9a0f858d1688f509628d8080388d"
     "e505f30d6b89b18f380f4e8c4e0d968f6f87418ff188e78df40ce585a58d1a0700000000000000000000000000000000"
     "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a003a"
     "003a003a003a003a003a003a003a003a00cc80cb00cb80ca00ca80c900c980c800c800c700c600c500c400c200c000bc"
     "0000003c0040004200440045004600470048804800498049004a804a004b804b"},
    {GgmlType::BF16,
     "87bf06bf8b3c523fe6bf06bf8d3f663ef8bf0f3f80bf9fbeba3ead3f88bff63fb93f31bf3b3f013e91bfcabfdcbf39bf"
     "bebf543faa3ef7be73bf803fdd3fa5bf2ab9f739e4b845380bb84040c0395839ea39f339b1b903b93f39acb900b7a7b9"
     "bd38be392db9f6b9e7398ab9aa39f3b9eeb8e8b91eb9bdb99f39bdb8b5b9e33800000000000000000000000000000000"
     "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f403f"
     "403f403f403f403f403f403f403f403f80c170c160c150c140c130c120c110c100c1e0c0c0c0a0c080c040c000c080bf"
     "0000803f004040408040a040c040e04000411041204130414041504160417041"},
};
// special_row(): numpy's float16 cast and gguf.quants.quantize(BF16).
const char kF16Special[] = "003c023cff7bff7b007c00000100010000000080007c00fc007c00be043c0c3c";
const char kBF16Special[] = "803f803f8047804780472c328033403300330080807f80ff1550c0bf803f823f";
// dequantize_row(random_blocks(t, seed)): gguf.quants.dequantize; FNV-1a 64 of the floats' bytes.
const DequantKat kDequantKats[] = {
    {GgmlType::F16, 64, 11, 0x4d812de1e6f64482ull,
     {{0, 0x40c7a000}, {1, 0x3a6b2000}, {15, 0xbf59c000}, {16, 0x399ee000},
      {31, 0x3d448000}, {32, 0xb8814000}, {33, 0x4248e000}, {63, 0x444dc000}}},
    {GgmlType::BF16, 64, 12, 0x43e817941811ba79ull,
     {{0, 0x5d3d0000}, {1, 0x1c090000}, {15, 0xe2640000}, {16, 0xa7ee0000},
      {31, 0x51240000}, {32, 0x2c5d0000}, {33, 0x8d010000}, {63, 0xec510000}}},
    {GgmlType::Q4_0, 4, 13, 0x863eca75b893593dull,
     {{0, 0x00000000}, {1, 0xbd27a000}, {15, 0xbdfb7000}, {16, 0x3d7b7000},
      {31, 0x00000000}, {33, 0x3e4c9000}, {64, 0x80000000}, {127, 0xbcab0000}}},
    {GgmlType::Q4_1, 4, 14, 0x4e874b6ac525d652ull,
     {{0, 0xbe903800}, {1, 0xbe903800}, {15, 0xbf60b000}, {16, 0xbf1ce000},
      {31, 0x3dece000}, {33, 0x3e365800}, {64, 0xbf036e00}, {127, 0xbeec2400}}},
    {GgmlType::Q5_0, 4, 15, 0x204871d8356993f1ull,
     {{0, 0xbe592600}, {1, 0xbc67a000}, {15, 0x3d90c400}, {16, 0xbe2db800},
      {31, 0xbe592600}, {33, 0xbe1ae000}, {64, 0xbe871800}, {127, 0x3f4f5800}}},
    {GgmlType::Q5_1, 4, 16, 0x8708b4eb478812f2ull,
     {{0, 0xbe6c2400}, {1, 0x3c58c000}, {15, 0xbf764d00}, {16, 0xbfa09a80},
      {31, 0xbe8f0a00}, {33, 0x3da23800}, {64, 0x40268880}, {127, 0xbdb2c000}}},
    {GgmlType::Q8_0, 4, 17, 0xac5e22f1490c7992ull,
     {{0, 0xbfb69580}, {1, 0xbf6d3400}, {15, 0x3fad3880}, {16, 0xbfb69580},
      {31, 0x3f7ccf00}, {33, 0x408f4d80}, {64, 0xc02be000}, {127, 0xbebd6400}}},
    {GgmlType::IQ4_NL, 4, 18, 0xcafa3dd580f844cdull,
     {{0, 0x40006f00}, {1, 0x3fb77a00}, {15, 0x3fb77a00}, {16, 0x40598d00},
      {31, 0xbf084c00}, {33, 0xc04d9500}, {64, 0x3f1a9a00}, {127, 0xbf979280}}},
    {GgmlType::Q4_K, 2, 19, 0x1ead67318bfce2e4ull,
     {{0, 0xc07f5a00}, {1, 0xc08f9580}, {15, 0xc092c400}, {16, 0xc0860a00},
      {31, 0xc095f280}, {33, 0xc078fd00}, {256, 0x40c530c0}, {511, 0x3d9a8000}}},
    {GgmlType::Q5_K, 2, 21, 0xe08ddda06cf62104ull,
     {{0, 0x42188bc0}, {1, 0x427f8ac0}, {15, 0x42931530}, {16, 0x429ff510},
      {31, 0x42c024c0}, {33, 0x41d1f178}, {256, 0xc0047600}, {511, 0x3ec6cc00}}},
    {GgmlType::Q6_K, 2, 20, 0x159119e876c8ca43ull,
     {{0, 0xbe430400}, {1, 0xbf5b6480}, {15, 0xbf73c500}, {16, 0x420d09c0},
      {31, 0x41b19a80}, {33, 0x41656790}, {256, 0x419f4e80}, {511, 0xc1c7394c}}},
};

TEST(GgmlQuantize, MatchesIndependentReferenceBytes) {
  const std::vector<float> x = kat_row();
  for (const QuantKat& kat : kQuantKats) {
    SCOPED_TRACE(ggml_type_info(kat.type)->name);
    const Bytes want = from_hex(kat.hex);
    const Bytes got = quantize(kat.type, x);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "byte " << i;
  }
  EXPECT_EQ(quantize(GgmlType::F16, special_row()), from_hex(kF16Special));
  EXPECT_EQ(quantize(GgmlType::BF16, special_row()), from_hex(kBF16Special));
}

TEST(GgmlDequant, MatchesIndependentReferenceValues) {
  for (const DequantKat& kat : kDequantKats) {
    SCOPED_TRACE(ggml_type_info(kat.type)->name);
    const GgmlTypeInfo& info = *ggml_type_info(kat.type);
    const std::vector<float> y =
        dequantize(kat.type, random_blocks(kat.type, kat.blocks, kat.seed), kat.blocks * info.block_size);
    for (const DequantKat::Sample& s : kat.samples)
      EXPECT_EQ(std::bit_cast<std::uint32_t>(y[s.index]), s.bits) << "element " << s.index;
    EXPECT_EQ(fnv1a64(y), kat.fnv);
  }
}

// Hand-worked IQ4_NL blocks: x = c·kvalues[j mod 16] makes the initial scale −max/127 put every
// element on its own code exactly, and the least-squares scale is then c itself.
TEST(GgmlQuantize, IQ4_NLOnTheCodeBook) {
  for (const auto& [c, d_bits] : {std::pair{0.01f, 0x211F}, std::pair{-0.5f, 0xB800}}) {
    std::vector<float> x(32);
    for (int j = 0; j < 32; ++j) x[j] = c * kIq4nl[j % 16];
    const Bytes b = quantize(GgmlType::IQ4_NL, x);
    EXPECT_EQ(b[0] | (b[1] << 8), d_bits) << "d = fp16(" << c << ")";
    for (int j = 0; j < 16; ++j) EXPECT_EQ(b[2 + j], j | (j << 4));
  }
}

// Hand-worked ties: ggml's Q8_0 rounds half away from zero; Q4_0 truncates x/d + 8.5.
TEST(GgmlQuantize, Ties) {
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f, x[1] = 0.5f, x[2] = -0.5f, x[3] = 1.5f, x[4] = 2.5f;  // d = 1: codes round(x)
  const Bytes q8 = quantize(GgmlType::Q8_0, x);
  EXPECT_EQ(q8[0] | (q8[1] << 8), 0x3C00);
  EXPECT_EQ(static_cast<std::int8_t>(q8[3]), 1);
  EXPECT_EQ(static_cast<std::int8_t>(q8[4]), -1);
  EXPECT_EQ(static_cast<std::int8_t>(q8[5]), 2);
  EXPECT_EQ(static_cast<std::int8_t>(q8[6]), 3);

  std::vector<float> y(32, 0.0f);
  y[0] = -8.0f, y[1] = 0.5f, y[2] = -0.5f, y[3] = 7.5f;  // d = 1: codes trunc(y + 8.5) capped at 15
  const Bytes q4 = quantize(GgmlType::Q4_0, y);
  EXPECT_EQ(q4[0] | (q4[1] << 8), 0x3C00);
  EXPECT_EQ(q4[2] & 15, 0);
  EXPECT_EQ(q4[3] & 15, 9);
  EXPECT_EQ(q4[4] & 15, 8);
  EXPECT_EQ(q4[5] & 15, 15);  // 16 capped
}

// ---- Round trips on Gaussian data: the worst error per element is within the format's step
// (plus the fp16 rounding of the stored scale and min).

TEST(GgmlQuantize, RoundTripErrorBounds) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int n = 32 * 64;
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng) * std::exp(normal(rng));
  const float fp16_rel = 0x1p-11f;

  auto block_stats = [&](int b, float* amax, float* lo, float* hi) {
    *amax = 0.0f, *lo = x[32 * b], *hi = x[32 * b];
    for (int j = 32 * b; j < 32 * (b + 1); ++j) {
      *amax = std::max(*amax, std::fabs(x[j]));
      *lo = std::min(*lo, x[j]);
      *hi = std::max(*hi, x[j]);
    }
  };
  const std::map<GgmlType, double> kRmsLimit = {{GgmlType::Q4_0, 0.155}, {GgmlType::Q4_1, 0.13},
                                                {GgmlType::Q5_0, 0.08},  {GgmlType::Q5_1, 0.065},
                                                {GgmlType::Q8_0, 0.011}, {GgmlType::IQ4_NL, 0.125}};
  std::map<GgmlType, double> rel_rms;
  for (const auto& [t, limit] : kRmsLimit) {
    SCOPED_TRACE(ggml_type_info(t)->name);
    const std::vector<float> y = dequantize(t, quantize(t, x), n);
    double se = 0.0, sx = 0.0;
    for (int b = 0; b < n / 32; ++b) {
      float amax, lo, hi;
      block_stats(b, &amax, &lo, &hi);
      float bound;  // per-element bound for this block
      switch (t) {
        // Symmetric: step amax/8 (amax/16); the value opposite the extreme may clip by one step.
        case GgmlType::Q4_0: bound = amax / 8 * (1 + 8 * fp16_rel) * 1.0001f; break;
        case GgmlType::Q5_0: bound = amax / 16 * (1 + 16 * fp16_rel) * 1.0001f; break;
        case GgmlType::Q8_0: bound = amax / 127 * (0.5f + 127 * fp16_rel) * 1.0001f; break;
        // Asymmetric: half a step, plus the fp16 rounding of the min and of the step.
        case GgmlType::Q4_1: bound = (hi - lo) / 15 * (0.5f + 15 * fp16_rel) + std::fabs(lo) * fp16_rel; break;
        case GgmlType::Q5_1: bound = (hi - lo) / 31 * (0.5f + 31 * fp16_rel) + std::fabs(lo) * fp16_rel; break;
        // Non-uniform code book, in units of amax/127: half the widest gap (89 → 113) is 12, the
        // book stops 14 short of +127, and the fitted scale stretches the grid; 0.2·amax covers all.
        default: bound = 0.2f * amax;
      }
      for (int j = 32 * b; j < 32 * (b + 1); ++j) {
        ASSERT_LE(std::fabs(y[j] - x[j]), bound) << "element " << j;
        se += static_cast<double>(y[j] - x[j]) * (y[j] - x[j]);
        sx += static_cast<double>(x[j]) * x[j];
      }
    }
    // Relative RMS error: about 20 % above what this data set gives (Q4_0 0.128, Q4_1 0.107,
    // Q5_0 0.067, Q5_1 0.054, Q8_0 0.0088, IQ4_NL 0.104), so a regression in the scale choice shows.
    rel_rms[t] = std::sqrt(se / sx);
    EXPECT_LT(rel_rms[t], limit);
  }
  EXPECT_LT(rel_rms[GgmlType::IQ4_NL], rel_rms[GgmlType::Q4_0]) << "the non-linear code book pays off";
  for (GgmlType t : {GgmlType::F16, GgmlType::BF16, GgmlType::F32}) {
    const std::vector<float> y = dequantize(t, quantize(t, x), n);
    // Half an ulp, relative; fp16 below 2^-14 has the absolute spacing 2^-24.
    const float rel = t == GgmlType::F16 ? 0x1p-11f : t == GgmlType::BF16 ? 0x1p-8f : 0.0f;
    const float abs = t == GgmlType::F16 ? 0x1p-25f : 0.0f;
    for (int j = 0; j < n; ++j) ASSERT_LE(std::fabs(y[j] - x[j]), std::fabs(x[j]) * rel + abs) << j;
  }
}

TEST(GgmlTypes, Errors) {
  std::vector<float> y(64);
  Bytes b(1024);
  EXPECT_THROW(ggml_row_bytes(GgmlType::Q4_0, 33), std::invalid_argument);
  EXPECT_THROW(ggml_row_bytes(GgmlType::Q4_K, -256), std::invalid_argument);
  EXPECT_THROW(ggml_row_bytes(static_cast<GgmlType>(99), 32), std::invalid_argument);
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q4_1, 576), 18u * 20u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q6_K, 512), 420u);
  EXPECT_THROW(dequantize_row(GgmlType::Q8_0, b.data(), y.data(), 40), std::invalid_argument);
  EXPECT_THROW(dequantize_row(GgmlType::Q2_K, b.data(), y.data(), 256), std::invalid_argument);
  EXPECT_THROW(dequantize_row(GgmlType::I32, b.data(), y.data(), 4), std::invalid_argument);
  EXPECT_THROW(dequantize_row(static_cast<GgmlType>(99), b.data(), y.data(), 32), std::invalid_argument);
  EXPECT_THROW(quantize_row(GgmlType::Q4_K, y.data(), b.data(), 256), std::invalid_argument);
  EXPECT_THROW(quantize_row(GgmlType::Q4_1, y.data(), b.data(), 48), std::invalid_argument);
  for (const GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1,
                           GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::IQ4_NL, GgmlType::Q4_K,
                           GgmlType::Q6_K})
    EXPECT_TRUE(ggml_type_info(t)->dequantizable);
}

}  // namespace
}  // namespace witcert::formats
