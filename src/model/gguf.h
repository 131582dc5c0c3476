// GGUF (v2 and v3) reader and a small writer for tests.
//
// Every offset, count and size read from a file is bounds-checked before use: a malformed or
// truncated file raises GgufError with a message naming what is wrong (which key, which tensor,
// which offset), never a crash or an out-of-bounds read. Tensor data is memory-mapped.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "formats/ggml/ggml_types.h"

namespace witcert::model {

class GgufError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Metadata value types, as stored in the file.
enum class GgufType : std::uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};

struct GgufArray;

// One metadata value. Integers of every width are held as int64/uint64 with their file type kept.
struct GgufValue {
  GgufType type = GgufType::UINT8;
  std::variant<std::uint64_t, std::int64_t, double, bool, std::string, std::shared_ptr<GgufArray>> v;
};

struct GgufArray {
  GgufType element_type = GgufType::UINT8;
  std::vector<GgufValue> items;  // nested arrays allowed
};

struct GgufTensorInfo {
  std::string name;
  std::vector<std::int64_t> ne;  // ne[0] is the contiguous dimension
  formats::GgmlType type = formats::GgmlType::F32;
  std::uint64_t offset = 0;      // relative to the start of the data section
  std::size_t bytes = 0;         // total bytes of the tensor's data
  std::int64_t elements() const;
};

class GgufFile {
 public:
  // Memory-maps and parses a file. Throws GgufError (missing file, bad magic, unsupported
  // version, truncation, an offset or size out of range, an unknown type, ...).
  static GgufFile open(const std::string& path);
  // Parses a byte buffer it copies (tests, fuzzing).
  static GgufFile from_bytes(std::span<const std::uint8_t> bytes);

  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

  std::uint32_t version() const;
  std::uint64_t alignment() const;
  const std::string& path() const;  // "" for from_bytes

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const;
  const GgufValue* find(std::string_view key) const;  // nullptr if absent

  // Typed access. The getters throw GgufError naming the key when it is missing or its type does
  // not fit (any integer type fits an integer getter whose range holds the value; FLOAT32 and
  // FLOAT64 fit get_f64). The *_or variants return the fallback when the key is absent.
  std::uint64_t get_u64(std::string_view key) const;
  std::uint32_t get_u32(std::string_view key) const;
  std::int64_t get_i64(std::string_view key) const;
  double get_f64(std::string_view key) const;
  bool get_bool(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  std::vector<std::string> get_string_array(std::string_view key) const;
  std::vector<std::int64_t> get_int_array(std::string_view key) const;
  std::vector<double> get_f64_array(std::string_view key) const;
  std::uint32_t get_u32_or(std::string_view key, std::uint32_t fallback) const;
  double get_f64_or(std::string_view key, double fallback) const;
  bool get_bool_or(std::string_view key, bool fallback) const;
  std::string get_string_or(std::string_view key, std::string fallback) const;

  const std::vector<GgufTensorInfo>& tensors() const;
  const GgufTensorInfo* find_tensor(std::string_view name) const;  // nullptr if absent
  const GgufTensorInfo& tensor(std::string_view name) const;       // throws GgufError if absent
  // The tensor's bytes (inside the mapping; valid while this object lives).
  std::span<const std::uint8_t> tensor_data(const GgufTensorInfo& t) const;

 private:
  struct Impl;
  explicit GgufFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Builds GGUF v3 files: tiny models and malformed variants for tests.
class GgufWriter {
 public:
  void add(std::string key, GgufValue value);
  void add_u32(std::string key, std::uint32_t v);
  void add_f32(std::string key, float v);
  void add_bool(std::string key, bool v);
  void add_string(std::string key, std::string v);
  void add_string_array(std::string key, const std::vector<std::string>& v);
  void add_i32_array(std::string key, const std::vector<std::int32_t>& v);
  void add_f32_array(std::string key, const std::vector<float>& v);
  // data.size() must equal the row bytes of ne for type (else std::invalid_argument). The writer
  // checks shapes and value ranges, not keys or names: duplicates are written as given.
  void add_tensor(std::string name, std::vector<std::int64_t> ne, formats::GgmlType type,
                  std::vector<std::uint8_t> data);
  void add_f32_tensor(std::string name, std::vector<std::int64_t> ne, const std::vector<float>& data);
  // A power of two, default 32; written as general.alignment (first key) unless it is 32.
  void set_alignment(std::uint32_t alignment);

  std::vector<std::uint8_t> bytes() const;
  void write(const std::string& path) const;  // throws GgufError on I/O failure

 private:
  std::vector<std::pair<std::string, GgufValue>> kv_;
  struct Tensor {
    std::string name;
    std::vector<std::int64_t> ne;
    formats::GgmlType type;
    std::vector<std::uint8_t> data;
  };
  std::vector<Tensor> tensors_;
  std::uint32_t alignment_ = 32;
};

}  // namespace witcert::model
