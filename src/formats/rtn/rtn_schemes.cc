// Round-to-nearest per token: symmetric absmax records at 8 and 4 bits, an asymmetric one at 2 bits.
#include "formats/scheme_kit.h"

namespace witcert::formats::kit {
namespace {

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

}  // namespace

std::vector<SchemeEntry> rtn_schemes() {
  static const RtnSymmetric int8("rtn-int8", 8), int4("rtn-int4", 4);
  static const Rtn2bit rtn2("rtn-2bit");
  return {{int8.name(), &int8, &int8}, {int4.name(), &int4, &int4}, {rtn2.name(), &rtn2, &rtn2}};
}

const KvScheme& kivi_value_scheme() {
  static const Rtn2bit kivi_value("kivi-2bit");
  return kivi_value;
}

}  // namespace witcert::formats::kit
