// rot-4bit: a fixed randomized Hadamard rotation, then rtn-int4 of the rotated token.
#include <algorithm>
#include <vector>

#include "formats/rotation/hadamard.h"
#include "formats/scheme_kit.h"

namespace witcert::formats::kit {
namespace {

// rot-4bit: rtn-int4 of the rotated token y = R·x (formats/rotation/hadamard.h); x̂ = Rᵀ·ŷ, so
// ‖x̂ − x‖ = ‖ŷ − y‖ ≤ √(Σ_g 32·s_g²/4). A non-finite value reaches every rotated coordinate, so
// the whole token decodes to NaN. A token with ‖x‖ > 7·65504 would overflow the fp16 scale to
// +inf and decode non-finite too; fp16 keys of real models are orders of magnitude below that.
class Rot4bit final : public Grouped {
 public:
  std::string_view name() const override { return "rot-4bit"; }
  PackedLayout layout() const override { return PackedLayout::rot_4bit; }
  void check_head_dim(int d) const override {
    require(d >= kChannelGroup && (d & (d - 1)) == 0, name(), "head_dim must be a power of two, at least 32", d);
  }
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    const std::span<double> y = scratch<double>(d);
    std::copy(x, x + d, y.begin());
    rotate(y);
    encode_token(y, out);
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    const std::span<double> y = scratch<double>(d);
    decode_token(in, y);
    unrotate(y);
    std::transform(y.begin(), y.end(), out, [](double v) { return static_cast<float>(v); });
  }

 protected:
  std::size_t record_bytes() const override { return symmetric_bytes(kChannelGroup, 4); }
  void encode_group(std::span<const double> v, std::uint8_t* out) const override { encode_symmetric(v, 4, out); }
  void decode_group(const std::uint8_t* in, std::span<double> out) const override { decode_symmetric(in, 4, out); }
};

}  // namespace

std::vector<SchemeEntry> rotation_schemes() {
  static const Rot4bit rot;
  return {{rot.name(), &rot, &rot}};
}

}  // namespace witcert::formats::kit
