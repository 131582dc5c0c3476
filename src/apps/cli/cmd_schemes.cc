#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "apps/cli/commands.h"
#include "base/fp16.h"
#include "formats/schemes.h"
#include "kvcache/kv_store.h"

namespace witcert::apps {
namespace {

// Bytes per token per head of one side, measured: one block of T tokens is encoded into a buffer
// of block_bytes followed by guard bytes, which must come back untouched.
double measured_bytes_per_token(const formats::KvScheme& s, int d) {
  const int T = s.tokens_per_block();
  std::vector<float> x(static_cast<std::size_t>(T) * d);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] =
        fp16_to_float(fp16_from_double(std::sin(0.37 * static_cast<double>(i) + 1.0) * static_cast<double>(1 + i % 7)));
  constexpr std::size_t kGuard = 64;
  constexpr std::uint8_t kGuardByte = 0xA5;
  const std::size_t bytes = s.block_bytes(d);
  std::vector<std::uint8_t> buffer(bytes + kGuard, kGuardByte);
  s.encode(x.data(), d, buffer.data());
  if (!std::all_of(buffer.begin() + static_cast<std::ptrdiff_t>(bytes), buffer.end(),
                   [](std::uint8_t b) { return b == kGuardByte; }))
    throw std::logic_error(std::string(s.name()) + " wrote past its block_bytes at head_dim " + std::to_string(d));
  return static_cast<double>(bytes) / T;
}

// Bytes per token per head of dither-int8 (Tier B), measured from kvcache::KvStore: the growth of
// the side's allocations from C to 2C tokens, divided by C. The per-(layer, KV head) outlier mask
// of d bytes does not grow with the tokens and is left out.
double dither_bytes_per_token(int bits, formats::KvSide side, int d, int outlier_pairs) {
  constexpr std::int64_t kTokens = 1024;
  const auto total = [&](std::int64_t capacity) {
    kvcache::CacheConfig cc;
    cc.layers = 1;
    cc.kv_heads = 1;
    cc.head_dim = d;
    cc.capacity = capacity;
    cc.k_format = cc.v_format = formats::KvFormat::dither(bits);
    cc.outlier_pairs = outlier_pairs;
    return kvcache::KvStore(cc).bytes_per_token_head(side) * static_cast<double>(capacity);
  };
  return (total(2 * kTokens) - total(kTokens)) / kTokens;
}

std::string kind(const formats::KvScheme& s) {
  return s.tokens_per_block() == 1 ? "per-token" : fmt::format("group T={}", s.tokens_per_block());
}

}  // namespace

int run_schemes(std::ostream& out) {
  out << "KV-cache schemes: bytes per token per head, measured by encoding one block of T tokens\n"
         "into a buffer of block_bytes and dividing by T; x fp16 = (2*2d) / (K + V). Tier A: any\n"
         "scheme, with a deterministic witness. Tier B: dither-int4/5/6/8 (B-bit codes, packed below 8\n"
         "bits, an fp16 scale per 32 channels; keys keep m outlier RoPE pairs in fp16, values a 4-byte\n"
         "bound per page of 16), measured from the cache's allocations per token\n\n";
  out << fmt::format("{:<16} {:<11} {:<11} {:>8} {:>8} {:>7} {:>8} {:>8} {:>7} {}\n", "scheme", "K kind", "V kind",
                     "d64 K", "d64 V", "x fp16", "d128 K", "d128 V", "x fp16", "tier");
  const auto bytes = [](double kb64, double vb64, double kb128, double vb128) {
    std::string cells;
    for (const auto& [d, kb, vb] : {std::tuple{64, kb64, vb64}, std::tuple{128, kb128, vb128}})
      cells += fmt::format(" {:>8.2f} {:>8.2f} {:>7.2f}", kb, vb, 4.0 * d / (kb + vb));
    return cells;
  };
  for (const std::string& name : formats::kv_scheme_names()) {
    const formats::KvScheme& k = formats::kv_scheme(name, formats::KvSide::key);
    const formats::KvScheme& v = formats::kv_scheme(name, formats::KvSide::value);
    out << fmt::format("{:<16} {:<11} {:<11}", name, kind(k), kind(v))
        << bytes(measured_bytes_per_token(k, 64), measured_bytes_per_token(v, 64), measured_bytes_per_token(k, 128),
                 measured_bytes_per_token(v, 128))
        << " A\n";
  }
  for (int bits : formats::kDitherBits)
  for (int m : {0, 4}) {
    const auto dither = [&](formats::KvSide side, int d) { return dither_bytes_per_token(bits, side, d, m); };
    out << fmt::format("{:<16} {:<11} {:<11}", formats::KvFormat::dither(bits).name(), fmt::format("token,m={}", m), "per-token")
        << bytes(dither(formats::KvSide::key, 64), dither(formats::KvSide::value, 64), dither(formats::KvSide::key, 128),
                 dither(formats::KvSide::value, 128))
        << " B\n";
  }
  return 0;
}

}  // namespace witcert::apps
