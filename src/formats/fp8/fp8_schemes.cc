// The fp8 KV caches: the raw E4M3 cast, and E4M3 under one fp16 scale per token.
#include <algorithm>
#include <cmath>

#include "formats/fp8/fp8.h"
#include "formats/scheme_kit.h"

namespace witcert::formats::kit {
namespace {

// fp8-e4m3: the raw saturating cast of fp8 KV caches, one byte per value and no scale.
class Fp8E4m3 final : public PerToken {
 public:
  std::string_view name() const override { return "fp8-e4m3"; }
  PackedLayout layout() const override { return PackedLayout::fp8_e4m3; }
  std::size_t block_bytes(int d) const override {
    check_head_dim(d);
    return static_cast<std::size_t>(d);
  }
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    for (int c = 0; c < d; ++c) out[c] = fp8_e4m3_from_double(x[c]);
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    const float* table = fp8_e4m3_float_table();
    for (int c = 0; c < d; ++c) out[c] = table[in[c]];
  }
};

// fp8-e4m3-scaled: [fp16 s][d fp8 codes], s = amax/448 rounded up so that x/s never saturates;
// x̂ = s·fp8(x/s). A non-finite token stores s = +inf and NaN codes.
class Fp8E4m3Scaled final : public PerToken {
 public:
  std::string_view name() const override { return "fp8-e4m3-scaled"; }
  PackedLayout layout() const override { return PackedLayout::fp8_e4m3_scaled; }
  std::size_t block_bytes(int d) const override {
    check_head_dim(d);
    return 2 + static_cast<std::size_t>(d);
  }
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    double amax = 0.0;
    bool finite = true;
    for (int c = 0; c < d; ++c) {
      finite = finite && std::isfinite(x[c]);
      amax = std::max(amax, std::fabs(double(x[c])));
    }
    const f16 s16 = finite ? fp16_from_double(amax / kFp8E4m3Max, Round::up) : kFp16PosInf;
    const double s = fp16_to_double(s16);
    store_f16(out, s16);
    for (int c = 0; c < d; ++c)
      out[2 + c] = !finite ? kFp8E4m3NaN : s == 0.0 ? std::uint8_t{0} : fp8_e4m3_from_double(x[c] / s);
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    const double s = fp16_to_double(load_f16(in));
    const float* table = fp8_e4m3_float_table();
    for (int c = 0; c < d; ++c) out[c] = static_cast<float>(s * static_cast<double>(table[in[2 + c]]));
  }
};

}  // namespace

std::vector<SchemeEntry> fp8_schemes() {
  static const Fp8E4m3 fp8;
  static const Fp8E4m3Scaled fp8_scaled;
  return {{fp8.name(), &fp8, &fp8}, {fp8_scaled.name(), &fp8_scaled, &fp8_scaled}};
}

}  // namespace witcert::formats::kit
