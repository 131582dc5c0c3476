// The group schemes, which quantize keys per channel along a block of T = 32 tokens (KIVI,
// KVQuant), and KVQuant's per-token values with their sparse outliers.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "formats/scheme_kit.h"

namespace witcert::formats::kit {
namespace {

// Channel c of a token-major block: the T values x[t·d + c], in the thread's scratch slot 1 (valid
// until the next call).
std::span<const double> channel(const float* x, int d, int c) {
  const std::span<double> v = scratch<double, 1>(kBlockTokens);
  for (int t = 0; t < kBlockTokens; ++t) v[t] = x[static_cast<std::size_t>(t) * d + c];
  return v;
}

void put_channel(std::span<const double> v, int d, int c, float* out) {
  for (int t = 0; t < kBlockTokens; ++t) out[static_cast<std::size_t>(t) * d + c] = static_cast<float>(v[t]);
}

// kivi-2bit keys (KIVI, Liu et al. 2024): per channel, a 2-bit asymmetric record over the block's
// 32 tokens, [fp16 s][fp16 lo][32 codes] (12 bytes), channel after channel. Per-channel ranges
// follow the outlier channels of keys; KIVI's fp16 residual window is the cache's exact tier.
class Kivi2bitKey final : public KvScheme {
 public:
  std::string_view name() const override { return "kivi-2bit"; }
  int tokens_per_block() const override { return kBlockTokens; }
  GroupLayout group_layout() const override { return GroupLayout::kivi_2bit; }
  std::size_t block_bytes(int d) const override {
    check_head_dim(d);
    return static_cast<std::size_t>(d) * asymmetric_bytes(kBlockTokens, 2);
  }
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    for (int c = 0; c < d; ++c) encode_asymmetric(channel(x, d, c), 2, out + c * asymmetric_bytes(kBlockTokens, 2));
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    const std::span<double> v = scratch<double, 1>(kBlockTokens);
    for (int c = 0; c < d; ++c) {
      decode_asymmetric(in + c * asymmetric_bytes(kBlockTokens, 2), 2, v);
      put_channel(v, d, c, out);
    }
  }
};

// KVQuant's dense-and-sparse split (Hooper et al. 2024): the top 1 % of a block's n entries by
// magnitude (at least one) are stored exactly as (uint16 index, fp16 value) and left out of the
// dense ranges, so one massive activation no longer sets the step of its whole channel.
int outlier_count(int n) { return std::max(1, n / 100); }
constexpr std::size_t kOutlierBytes = 4;

// The indices of the outliers of v in increasing order (outlier_count of them, in the thread's
// int scratch, valid until the next call). Non-finite entries rank above every finite one, so
// they are stored exactly (an fp16 inf or NaN) rather than spoil a range; ties go to the lower
// index.
std::span<const int> outliers(std::span<const double> v) {
  const auto magnitude = [&](int i) { return std::isnan(v[i]) ? INFINITY : std::fabs(v[i]); };
  const std::span<int> order = scratch<int>(v.size());
  std::iota(order.begin(), order.end(), 0);
  const int k = outlier_count(static_cast<int>(v.size()));
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return magnitude(a) != magnitude(b) ? magnitude(a) > magnitude(b) : a < b; });
  std::sort(order.begin(), order.begin() + k);
  return order.first(k);
}

void encode_outliers(std::span<const double> v, std::span<const int> idx, std::uint8_t* out) {
  for (int i : idx) {
    out[0] = static_cast<std::uint8_t>(i & 0xFF);
    out[1] = static_cast<std::uint8_t>(i >> 8);
    store_f16(out + 2, fp16_from_double(v[i]));
    out += kOutlierBytes;
  }
}

void decode_outliers(const std::uint8_t* in, int count, std::span<double> v) {
  for (int k = 0; k < count; ++k, in += kOutlierBytes) v[in[0] | (in[1] << 8)] = fp16_to_double(load_f16(in + 2));
}

// kvquant-4 keys: per channel, a 4-bit asymmetric record over the block's 32 tokens,
// [fp16 s][fp16 lo][32 codes] (20 bytes), channel after channel, then the block's outliers
// (indices t·d + c).
class Kvquant4Key final : public KvScheme {
 public:
  std::string_view name() const override { return "kvquant-4"; }
  int tokens_per_block() const override { return kBlockTokens; }
  GroupLayout group_layout() const override { return GroupLayout::kvquant_4; }
  void check_head_dim(int d) const override {
    require(d > 0 && kBlockTokens * d <= 65536, name(), "32·head_dim must fit a 16-bit outlier index", d);
  }
  std::size_t block_bytes(int d) const override {
    check_head_dim(d);
    return static_cast<std::size_t>(d) * asymmetric_bytes(kBlockTokens, 4) +
           outlier_count(kBlockTokens * d) * kOutlierBytes;
  }
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    const std::span<double> block = scratch<double>(static_cast<std::size_t>(kBlockTokens) * d);
    std::copy(x, x + block.size(), block.begin());
    const std::span<const int> idx = outliers(block);
    const std::span<std::uint8_t> sparse = scratch<std::uint8_t>(block.size());
    std::fill(sparse.begin(), sparse.end(), std::uint8_t{0});
    for (int i : idx) sparse[i] = 1;
    const std::span<std::uint8_t> skip = scratch<std::uint8_t, 1>(kBlockTokens);
    for (int c = 0; c < d; ++c) {
      for (int t = 0; t < kBlockTokens; ++t) skip[t] = sparse[static_cast<std::size_t>(t) * d + c];
      encode_asymmetric(channel(x, d, c), 4, out + c * asymmetric_bytes(kBlockTokens, 4), skip);
    }
    encode_outliers(block, idx, out + d * asymmetric_bytes(kBlockTokens, 4));
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    const std::span<double> block = scratch<double>(static_cast<std::size_t>(kBlockTokens) * d);
    const std::span<double> v = scratch<double, 1>(kBlockTokens);
    for (int c = 0; c < d; ++c) {
      decode_asymmetric(in + c * asymmetric_bytes(kBlockTokens, 4), 4, v);
      for (int t = 0; t < kBlockTokens; ++t) block[static_cast<std::size_t>(t) * d + c] = v[t];
    }
    decode_outliers(in + d * asymmetric_bytes(kBlockTokens, 4), outlier_count(kBlockTokens * d), block);
    std::transform(block.begin(), block.end(), out, [](double y) { return static_cast<float>(y); });
  }
};

// kvquant-4 values: per token, one 4-bit asymmetric record over the head dimension,
// [fp16 s][fp16 lo][d codes], then the token's outliers (indices c).
class Kvquant4Value final : public KvScheme {
 public:
  std::string_view name() const override { return "kvquant-4"; }
  int tokens_per_block() const override { return 1; }
  PackedLayout layout() const override { return PackedLayout::kvquant4_token; }
  void check_head_dim(int d) const override {
    require(d > 0 && d <= 65536, name(), "head_dim must fit a 16-bit outlier index", d);
  }
  std::size_t block_bytes(int d) const override {
    check_head_dim(d);
    return asymmetric_bytes(d, 4) + outlier_count(d) * kOutlierBytes;
  }
  void encode(const float* x, int d, std::uint8_t* out) const override {
    check_head_dim(d);
    const std::span<double> v = scratch<double>(d);
    std::copy(x, x + d, v.begin());
    const std::span<const int> idx = outliers(v);
    const std::span<std::uint8_t> skip = scratch<std::uint8_t>(d);
    std::fill(skip.begin(), skip.end(), std::uint8_t{0});
    for (int i : idx) skip[i] = 1;
    encode_asymmetric(v, 4, out, skip);
    encode_outliers(v, idx, out + asymmetric_bytes(d, 4));
  }
  void decode(const std::uint8_t* in, int d, float* out) const override {
    check_head_dim(d);
    const std::span<double> v = scratch<double>(d);
    decode_asymmetric(in, 4, v);
    decode_outliers(in + asymmetric_bytes(d, 4), outlier_count(d), v);
    std::transform(v.begin(), v.end(), out, [](double y) { return static_cast<float>(y); });
  }
};

}  // namespace

std::vector<SchemeEntry> group_schemes() {
  static const Kivi2bitKey kivi_key;
  static const Kvquant4Key kvquant_key;
  static const Kvquant4Value kvquant_value;
  return {{kivi_key.name(), &kivi_key, &kivi_value_scheme()}, {kvquant_key.name(), &kvquant_key, &kvquant_value}};
}

}  // namespace witcert::formats::kit
