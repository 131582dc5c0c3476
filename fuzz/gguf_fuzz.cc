// libFuzzer target for the GGUF reader: every input must either parse or raise GgufError; any
// other exception, crash or sanitizer report is a bug. A parsed file is walked completely
// (every value, every getter, every tensor's bytes) so that what the reader accepted is also
// safe to use.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "model/gguf.h"

namespace {

using witcert::model::GgufArray;
using witcert::model::GgufError;
using witcert::model::GgufFile;
using witcert::model::GgufValue;

std::uint64_t visit(const GgufValue& v) {
  std::uint64_t h = static_cast<std::uint64_t>(v.type);
  if (const auto* s = std::get_if<std::string>(&v.v)) {
    for (char c : *s) h = h * 31 + static_cast<unsigned char>(c);
  } else if (const auto* a = std::get_if<std::shared_ptr<GgufArray>>(&v.v)) {
    for (const GgufValue& item : (*a)->items) h = h * 31 + visit(item);
  } else if (const auto* u = std::get_if<std::uint64_t>(&v.v)) {
    h += *u;
  }
  return h;
}

template <class Fn>
void tolerate(Fn fn) {
  try {
    fn();
  } catch (const GgufError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  volatile std::uint64_t sink = 0;
  try {
    const GgufFile f = GgufFile::from_bytes(std::span<const std::uint8_t>(data, size));
    sink = sink + f.version() + f.alignment();
    for (const auto& entry : f.metadata()) {
      const std::string& key = entry.first;  // clang 14 cannot capture structured bindings
      sink = sink + visit(entry.second) + (f.find(key) == &entry.second);
      tolerate([&] { sink = sink + f.get_u64(key); });
      tolerate([&] { sink = sink + f.get_u32(key); });
      tolerate([&] { sink = sink + static_cast<std::uint64_t>(f.get_i64(key)); });
      tolerate([&] { sink = sink + (f.get_f64(key) > 0); });
      tolerate([&] { sink = sink + f.get_bool(key); });
      tolerate([&] { sink = sink + f.get_string(key).size(); });
      tolerate([&] { sink = sink + f.get_string_array(key).size(); });
      tolerate([&] { sink = sink + f.get_int_array(key).size(); });
      tolerate([&] { sink = sink + f.get_f64_array(key).size(); });
    }
    for (const auto& t : f.tensors()) {
      const std::span<const std::uint8_t> bytes = f.tensor_data(t);
      sink = sink + static_cast<std::uint64_t>(t.elements()) + bytes.front() + bytes.back();
      sink = sink + (&f.tensor(t.name) == &t);
    }
  } catch (const GgufError&) {
  }
  return 0;
}
