#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <ostream>
#include <stdexcept>
#include <vector>

#include "apps/cli/commands.h"
#include "formats/dither/philox.h"

namespace witcert::apps {
namespace {

std::vector<std::uint32_t> parse_words(const std::string& text, std::size_t count) {
  std::vector<std::uint32_t> words;
  std::size_t begin = 0;
  while (true) {
    const std::size_t end = text.find(',', begin);
    const std::string word = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    const bool hex = word.size() > 2 && word[0] == '0' && (word[1] == 'x' || word[1] == 'X');
    const std::string digits = hex ? word.substr(2) : word;
    const std::string allowed = hex ? "0123456789abcdefABCDEF" : "0123456789";
    if (digits.empty() || digits.find_first_not_of(allowed) != std::string::npos)
      throw std::invalid_argument("'" + word + "' is not a decimal or 0x-hex word in '" + text + "'");
    errno = 0;
    const unsigned long long v = std::strtoull(digits.c_str(), nullptr, hex ? 16 : 10);
    if (errno == ERANGE || v > 0xFFFFFFFFull)
      throw std::invalid_argument("'" + word + "' does not fit in 32 bits");
    words.push_back(static_cast<std::uint32_t>(v));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  if (words.size() != count)
    throw std::invalid_argument("expected " + std::to_string(count) + " comma-separated words, got " +
                                std::to_string(words.size()) + " in '" + text + "'");
  return words;
}

}  // namespace

std::array<std::uint32_t, 4> parse_words4(const std::string& text) {
  const auto w = parse_words(text, 4);
  return {w[0], w[1], w[2], w[3]};
}

std::array<std::uint32_t, 2> parse_words2(const std::string& text) {
  const auto w = parse_words(text, 2);
  return {w[0], w[1]};
}

int run_philox(const std::string& counter, const std::string& key, std::ostream& out) {
  const auto r = formats::philox4x32_10(parse_words4(counter), parse_words2(key));
  out << fmt::format("{:08x} {:08x} {:08x} {:08x}\n", r[0], r[1], r[2], r[3]);
  return 0;
}

}  // namespace witcert::apps
