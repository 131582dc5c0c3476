// llama.cpp's KV-cache formats (--cache-type-k/-v): GGML blocks of 32 values along the head
// dimension, encoded and decoded by the reference quantize_row / dequantize_row, so the bytes are
// the ones llama.cpp stores.
#include <algorithm>
#include <cmath>
#include <vector>

#include "formats/ggml/ggml_types.h"
#include "formats/scheme_kit.h"

namespace witcert::formats::kit {
namespace {

class GgmlScheme final : public KvScheme {
 public:
  GgmlScheme(std::string_view name, GgmlType type) : name_(name), type_(type) {}
  std::string_view name() const override { return name_; }
  int tokens_per_block() const override { return 1; }
  void check_head_dim(int d) const override {
    require(d > 0 && d % block_size() == 0, name(), "head_dim must be a positive multiple of 32 (the GGML block)", d);
  }
  std::size_t block_bytes(int d) const override {
    check_head_dim(d);
    return ggml_row_bytes(type_, d);
  }
  // llama.cpp's quantizers turn a non-finite value into finite garbage or undefined behaviour (a
  // NaN cast to int): such a block is quantized with its non-finite values zeroed and then gets a
  // NaN block scale d, the fp16 that opens every one of these layouts and multiplies every decoded
  // value.
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    const auto non_finite = [](float v) { return !std::isfinite(v); };
    if (std::none_of(x, x + d, non_finite)) return quantize_row(type_, x, out, d);  // in place: no copy
    const std::span<float> finite = scratch<float>(d);
    std::replace_copy_if(x, x + d, finite.begin(), non_finite, 0.0f);
    quantize_row(type_, finite.data(), out, d);
    const std::size_t block = ggml_type_info(type_)->block_bytes;
    for (int g = 0; g < d / block_size(); ++g)
      if (std::any_of(x + g * block_size(), x + (g + 1) * block_size(), non_finite)) store_f16(out + g * block, 0x7E00);
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    dequantize_row(type_, in, out, d);
  }
  PackedLayout layout() const override {
    switch (type_) {
      case GgmlType::Q8_0: return PackedLayout::q8_0;
      case GgmlType::Q4_0: return PackedLayout::q4_0;
      case GgmlType::Q4_1: return PackedLayout::q4_1;
      case GgmlType::Q5_0: return PackedLayout::q5_0;
      case GgmlType::Q5_1: return PackedLayout::q5_1;
      case GgmlType::IQ4_NL: return PackedLayout::iq4_nl;
      default: return PackedLayout::opaque;
    }
  }

 private:
  int block_size() const { return static_cast<int>(ggml_type_info(type_)->block_size); }

  std::string_view name_;
  GgmlType type_;
};

}  // namespace

std::vector<SchemeEntry> ggml_schemes() {
  static const GgmlScheme q8_0("q8_0", GgmlType::Q8_0), q4_0("q4_0", GgmlType::Q4_0), q4_1("q4_1", GgmlType::Q4_1),
      q5_0("q5_0", GgmlType::Q5_0), q5_1("q5_1", GgmlType::Q5_1), iq4_nl("iq4_nl", GgmlType::IQ4_NL);
  std::vector<SchemeEntry> entries;
  for (const GgmlScheme* s : {&q8_0, &q4_0, &q4_1, &q5_0, &q5_1, &iq4_nl}) entries.push_back({s->name(), s, s});
  return entries;
}

}  // namespace witcert::formats::kit
