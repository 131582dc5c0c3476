#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "base/fp16.h"
#include "quant/schemes.h"

namespace witcert::apps {
namespace {

// Bytes per token per head of one side, measured: one block of T tokens is encoded into a buffer
// of block_bytes followed by guard bytes, which must come back untouched.
double measured_bytes_per_token(const quant::KvScheme& s, int d) {
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

std::string kind(const quant::KvScheme& s) {
  return s.tokens_per_block() == 1 ? "per-token" : fmt::format("group T={}", s.tokens_per_block());
}

}  // namespace

int run_schemes(std::ostream& out) {
  out << "KV-cache schemes: bytes per token per head, measured by encoding one block of T tokens\n"
         "into a buffer of block_bytes and dividing by T; x fp16 = (2*2d) / (K + V)\n\n";
  out << fmt::format("{:<16} {:<11} {:<11} {:>8} {:>8} {:>7} {:>8} {:>8} {:>7}\n", "scheme", "K kind", "V kind",
                     "d64 K", "d64 V", "x fp16", "d128 K", "d128 V", "x fp16");
  for (const std::string& name : quant::kv_scheme_names()) {
    const quant::KvScheme& k = quant::kv_scheme(name, quant::KvSide::key);
    const quant::KvScheme& v = quant::kv_scheme(name, quant::KvSide::value);
    std::string row = fmt::format("{:<16} {:<11} {:<11}", name, kind(k), kind(v));
    for (int d : {64, 128}) {
      const double kb = measured_bytes_per_token(k, d), vb = measured_bytes_per_token(v, d);
      row += fmt::format(" {:>8.2f} {:>8.2f} {:>7.2f}", kb, vb, 4.0 * d / (kb + vb));
    }
    out << row << "\n";
  }
  return 0;
}

}  // namespace witcert::apps
