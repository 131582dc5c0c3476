// sign-1bit: one sign bit a value and one fp16 magnitude per group of 32 channels.
#include <cmath>
#include <vector>

#include "formats/scheme_kit.h"

namespace witcert::formats::kit {
namespace {

// sign-1bit: [fp16 m][32 sign bits] per group of 32 channels, m = mean |x| (the scale that
// minimizes the squared error of x̂ = ±m), bit 1 for a negative value (sign bit set).
class Sign1bit final : public Grouped {
 public:
  std::string_view name() const override { return "sign-1bit"; }
  PackedLayout layout() const override { return PackedLayout::sign_1bit; }

 protected:
  std::size_t record_bytes() const override { return 2 + packed_bytes(kChannelGroup, 1); }
  void encode_group(std::span<const double> v, std::uint8_t* out) const override {
    double sum = 0.0;
    const std::span<unsigned> negative = scratch<unsigned>(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      sum += std::fabs(v[i]);
      negative[i] = std::signbit(v[i]) ? 1u : 0u;
    }
    // A NaN makes the sum NaN and an inf makes it inf: both are stored as +inf.
    const double m = sum / static_cast<double>(v.size());
    store_f16(out, std::isfinite(m) ? fp16_from_double(m) : kFp16PosInf);
    pack(negative, 1, out + 2);
  }
  void decode_group(const std::uint8_t* in, std::span<double> out) const override {
    const double m = fp16_to_double(load_f16(in));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = unpack(in + 2, static_cast<int>(i), 1) ? -m : m;
  }
};

}  // namespace

std::vector<SchemeEntry> sign_schemes() {
  static const Sign1bit sign;
  return {{sign.name(), &sign, &sign}};
}

}  // namespace witcert::formats::kit
