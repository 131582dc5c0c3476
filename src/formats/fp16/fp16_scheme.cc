// fp16, the exact format: the reference every other format is measured against.
#include "formats/scheme_kit.h"

namespace witcert::formats::kit {
namespace {

// fp16: the reference itself; decode returns exactly the value the exact tier holds.
class Fp16 final : public PerToken {
 public:
  std::string_view name() const override { return "fp16"; }
  bool exact() const override { return true; }
  PackedLayout layout() const override { return PackedLayout::fp16; }
  std::size_t block_bytes(int d) const override {
    check_head_dim(d);
    return 2 * static_cast<std::size_t>(d);
  }
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    for (int c = 0; c < d; ++c) store_f16(out + 2 * c, fp16_from_double(x[c]));
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    for (int c = 0; c < d; ++c) out[c] = fp16_to_float(load_f16(in + 2 * c));
  }
};

}  // namespace

std::vector<SchemeEntry> fp16_schemes() {
  static const Fp16 fp16;
  return {{fp16.name(), &fp16, &fp16}};
}

}  // namespace witcert::formats::kit
