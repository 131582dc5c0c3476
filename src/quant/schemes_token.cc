// The per-token schemes: each token vector is encoded on its own, the moment it is written.
#include <algorithm>
#include <cmath>
#include <vector>

#include "quant/fp8.h"
#include "quant/hadamard.h"
#include "quant/scheme_kit.h"

namespace witcert::quant::kit {
namespace {

class PerToken : public KvScheme {
 public:
  int tokens_per_block() const override { return 1; }
};

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

// Per-token schemes made of one quantizer record per group of 32 channels.
class Grouped : public PerToken {
 public:
  void check_head_dim(int d) const override {
    require(d > 0 && d % kChannelGroup == 0, name(), "head_dim must be a positive multiple of 32", d);
  }
  std::size_t block_bytes(int d) const override {
    check_head_dim(d);
    return static_cast<std::size_t>(d / kChannelGroup) * record_bytes();
  }
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    std::vector<double> v(x, x + d);
    encode_token(v, out);
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    std::vector<double> v(d);
    decode_token(in, v);
    std::transform(v.begin(), v.end(), out, [](double y) { return static_cast<float>(y); });
  }

 protected:
  virtual std::size_t record_bytes() const = 0;
  virtual void encode_group(std::span<const double> v, std::uint8_t* out) const = 0;
  virtual void decode_group(const std::uint8_t* in, std::span<double> out) const = 0;
  void encode_token(std::span<const double> v, std::uint8_t* out) const {
    for (std::size_t g = 0; g < v.size() / kChannelGroup; ++g)
      encode_group(v.subspan(g * kChannelGroup, kChannelGroup), out + g * record_bytes());
  }
  void decode_token(const std::uint8_t* in, std::span<double> out) const {
    for (std::size_t g = 0; g < out.size() / kChannelGroup; ++g)
      decode_group(in + g * record_bytes(), out.subspan(g * kChannelGroup, kChannelGroup));
  }
};

// rtn-int8, rtn-int4: symmetric absmax round-to-nearest, one fp16 scale per group of 32 channels.
class RtnSymmetric final : public Grouped {
 public:
  RtnSymmetric(std::string_view name, int bits) : name_(name), bits_(bits) {}
  std::string_view name() const override { return name_; }
  PackedLayout layout() const override {
    return bits_ == 8 ? PackedLayout::rtn_int8 : bits_ == 4 ? PackedLayout::rtn_int4 : PackedLayout::opaque;
  }

 protected:
  std::size_t record_bytes() const override { return symmetric_bytes(kChannelGroup, bits_); }
  void encode_group(std::span<const double> v, std::uint8_t* out) const override { encode_symmetric(v, bits_, out); }
  void decode_group(const std::uint8_t* in, std::span<double> out) const override { decode_symmetric(in, bits_, out); }

 private:
  std::string_view name_;
  int bits_;
};

// rtn-2bit (and KIVI's values): asymmetric 2-bit round-to-nearest, fp16 scale and min per group
// of 32 channels.
class Rtn2bit final : public Grouped {
 public:
  explicit Rtn2bit(std::string_view name) : name_(name) {}
  std::string_view name() const override { return name_; }
  PackedLayout layout() const override { return PackedLayout::rtn_2bit; }

 protected:
  std::size_t record_bytes() const override { return asymmetric_bytes(kChannelGroup, 2); }
  void encode_group(std::span<const double> v, std::uint8_t* out) const override { encode_asymmetric(v, 2, out); }
  void decode_group(const std::uint8_t* in, std::span<double> out) const override { decode_asymmetric(in, 2, out); }

 private:
  std::string_view name_;
};

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
    std::vector<unsigned> negative(v.size());
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

// rot-4bit: rtn-int4 of the rotated token y = R·x (quant/hadamard.h); x̂ = Rᵀ·ŷ, so
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
    std::vector<double> y(x, x + d);
    rotate(y);
    encode_token(y, out);
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    std::vector<double> y(d);
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

std::vector<SchemeEntry> token_schemes() {
  static const Fp16 fp16;
  static const Fp8E4m3 fp8;
  static const Fp8E4m3Scaled fp8_scaled;
  static const RtnSymmetric int8("rtn-int8", 8), int4("rtn-int4", 4);
  static const Rtn2bit rtn2("rtn-2bit");
  static const Sign1bit sign;
  static const Rot4bit rot;
  return {{fp16.name(), &fp16, &fp16}, {fp8.name(), &fp8, &fp8},    {fp8_scaled.name(), &fp8_scaled, &fp8_scaled},
          {int8.name(), &int8, &int8}, {int4.name(), &int4, &int4}, {rtn2.name(), &rtn2, &rtn2},
          {sign.name(), &sign, &sign}, {rot.name(), &rot, &rot}};
}

const KvScheme& kivi_value_scheme() {
  static const Rtn2bit kivi_value("kivi-2bit");
  return kivi_value;
}

}  // namespace witcert::quant::kit
