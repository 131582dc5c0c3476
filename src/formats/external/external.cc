#include "formats/external/external.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace witcert::formats {
namespace {

thread_local std::span<const float> t_pending[2];

class External final : public KvScheme {
 public:
  explicit External(KvSide side) : side_(side) {}
  std::string_view name() const override { return "external"; }
  int tokens_per_block() const override { return 1; }
  std::size_t block_bytes(int head_dim) const override { return sizeof(float) * static_cast<std::size_t>(head_dim); }
  void encode(const float*, int head_dim, std::uint8_t* out) const override {
    const std::span<const float> r = t_pending[static_cast<int>(side_)];
    if (r.size() != static_cast<std::size_t>(head_dim))
      throw std::logic_error(std::string("external ") + (side_ == KvSide::key ? "key" : "value") +
                             " written without its reconstruction");
    std::memcpy(out, r.data(), block_bytes(head_dim));
  }
  void decode(const std::uint8_t* in, int head_dim, float* out) const override {
    std::memcpy(out, in, block_bytes(head_dim));
  }

 private:
  KvSide side_;
};

}  // namespace

const KvScheme& external_scheme(KvSide side) {
  static const External key(KvSide::key), value(KvSide::value);
  return side == KvSide::key ? key : value;
}

ExternalReconstruction::ExternalReconstruction(std::span<const float> key, std::span<const float> value) {
  t_pending[static_cast<int>(KvSide::key)] = key;
  t_pending[static_cast<int>(KvSide::value)] = value;
}

ExternalReconstruction::~ExternalReconstruction() { t_pending[0] = t_pending[1] = {}; }

}  // namespace witcert::formats
