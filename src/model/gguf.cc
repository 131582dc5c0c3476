#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <new>
#include <utility>

namespace witcert::model {
namespace {

constexpr std::uint64_t kDefaultAlignment = 32;
constexpr std::uint32_t kMaxDims = 4;
// No model nests metadata arrays more than twice; the limit keeps the recursion shallow.
constexpr int kMaxArrayDepth = 8;
// Each array item becomes a GgufValue of ~48 bytes, so without a cap a file could buy 48× its
// size in memory with one-byte items. Real tokenizers hold well under a million strings.
constexpr std::uint64_t kMaxArrayItems = std::uint64_t{1} << 24;
// from_bytes copies land on this boundary, like the page-aligned mapping, so tensor data keeps
// the alignment the file promises (up to this much).
constexpr std::size_t kCopyAlignment = 64;

static_assert(sizeof(std::size_t) == sizeof(std::uint64_t), "tensor sizes are held in size_t");

constexpr std::uint32_t kLastType = static_cast<std::uint32_t>(GgufType::FLOAT64);

const char* type_name(GgufType t) {
  switch (t) {
    case GgufType::UINT8: return "UINT8";
    case GgufType::INT8: return "INT8";
    case GgufType::UINT16: return "UINT16";
    case GgufType::INT16: return "INT16";
    case GgufType::UINT32: return "UINT32";
    case GgufType::INT32: return "INT32";
    case GgufType::FLOAT32: return "FLOAT32";
    case GgufType::BOOL: return "BOOL";
    case GgufType::STRING: return "STRING";
    case GgufType::ARRAY: return "ARRAY";
    case GgufType::UINT64: return "UINT64";
    case GgufType::INT64: return "INT64";
    case GgufType::FLOAT64: return "FLOAT64";
  }
  return "?";
}

std::string describe(const GgufValue& v) {
  std::string s = type_name(v.type);
  if (const auto* a = std::get_if<std::shared_ptr<GgufArray>>(&v.v); a && *a)
    s += std::string(" of ") + type_name((*a)->element_type);
  return s;
}

// Width in bytes of a fixed-size type, 0 for STRING and ARRAY.
int fixed_width(GgufType t) {
  switch (t) {
    case GgufType::UINT8:
    case GgufType::INT8:
    case GgufType::BOOL: return 1;
    case GgufType::UINT16:
    case GgufType::INT16: return 2;
    case GgufType::UINT32:
    case GgufType::INT32:
    case GgufType::FLOAT32: return 4;
    case GgufType::UINT64:
    case GgufType::INT64:
    case GgufType::FLOAT64: return 8;
    case GgufType::STRING:
    case GgufType::ARRAY: return 0;
  }
  return 0;
}

bool is_signed(GgufType t) {
  return t == GgufType::INT8 || t == GgufType::INT16 || t == GgufType::INT32 || t == GgufType::INT64;
}

// The fewest bytes a value of type t occupies: bounds a count before anything is allocated.
std::uint64_t min_value_bytes(GgufType t) {
  if (t == GgufType::STRING) return 8;  // the length
  if (t == GgufType::ARRAY) return 12;  // element type and count
  return static_cast<std::uint64_t>(fixed_width(t));
}

// Names and keys come from the file: escape them and cut them short so an error stays readable.
std::string quote(std::string_view s) {
  constexpr std::size_t kMax = 80;
  std::string out = "'";
  for (std::size_t i = 0; i < s.size() && i < kMax; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (s.size() > kMax) out += "...";
  return out + "'";
}

std::string str(std::uint64_t v) { return std::to_string(v); }

// Reads little-endian fields of the header; every error names the item being read.
class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> bytes) : bytes_(bytes) {}

  std::uint64_t pos() const { return pos_; }
  std::uint64_t remaining() const { return bytes_.size() - pos_; }

  void set_context(std::string context) {
    context_ = std::move(context);
    indices_.clear();
  }
  // Array indices appended to the context, innermost last.
  std::vector<std::uint64_t>& indices() { return indices_; }

  [[noreturn]] void fail(const std::string& msg) const {
    std::string where = context_;
    for (std::uint64_t i : indices_) {
      where += '[';
      where += str(i);
      where += ']';
    }
    throw GgufError(where.empty() ? msg : where + ": " + msg);
  }

  std::uint64_t uint(int width, const char* what) {
    if (static_cast<std::uint64_t>(width) > remaining())
      fail(std::string("truncated: ") + what + " at offset " + str(pos_) + " needs " + str(width) +
           " bytes, " + str(remaining()) + " remain");
    std::uint64_t v = 0;
    for (int i = 0; i < width; ++i) v |= std::uint64_t{bytes_[pos_ + i]} << (8 * i);
    pos_ += width;
    return v;
  }
  std::uint32_t u32(const char* what) { return static_cast<std::uint32_t>(uint(4, what)); }
  std::uint64_t u64(const char* what) { return uint(8, what); }

  std::string string(const char* what) {
    const std::uint64_t n = u64(what);
    if (n > remaining())
      fail(std::string(what) + " of " + str(n) + " bytes at offset " + str(pos_) +
           " extends past the end of the file (" + str(remaining()) + " bytes remain)");
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  std::span<const std::uint8_t> bytes_;
  std::uint64_t pos_ = 0;
  std::string context_;
  std::vector<std::uint64_t> indices_;
};

std::shared_ptr<GgufArray> read_array(Reader& r, int depth, std::uint64_t& items_left);

GgufValue read_value(Reader& r, GgufType type, int depth, std::uint64_t& items_left) {
  GgufValue out;
  out.type = type;
  const int width = fixed_width(type);
  switch (type) {
    case GgufType::UINT8:
    case GgufType::UINT16:
    case GgufType::UINT32:
    case GgufType::UINT64: out.v = r.uint(width, "value"); break;
    case GgufType::INT8:
    case GgufType::INT16:
    case GgufType::INT32:
    case GgufType::INT64: {
      // Sign-extend from the field's width.
      const int shift = 64 - 8 * width;
      out.v = static_cast<std::int64_t>(r.uint(width, "value") << shift) >> shift;
      break;
    }
    case GgufType::FLOAT32:
      out.v = static_cast<double>(std::bit_cast<float>(static_cast<std::uint32_t>(r.uint(4, "value"))));
      break;
    case GgufType::FLOAT64: out.v = std::bit_cast<double>(r.uint(8, "value")); break;
    case GgufType::BOOL: {
      const std::uint64_t b = r.uint(1, "value");
      if (b > 1) r.fail("invalid BOOL byte " + str(b) + " (must be 0 or 1)");
      out.v = b == 1;
      break;
    }
    case GgufType::STRING: out.v = r.string("string"); break;
    case GgufType::ARRAY: out.v = read_array(r, depth + 1, items_left); break;
  }
  return out;
}

std::shared_ptr<GgufArray> read_array(Reader& r, int depth, std::uint64_t& items_left) {
  if (depth > kMaxArrayDepth) r.fail("arrays nested more than " + str(kMaxArrayDepth) + " deep");
  const std::uint32_t raw = r.u32("array element type");
  if (raw > kLastType) r.fail("unknown array element type " + str(raw));
  const auto element = static_cast<GgufType>(raw);
  const std::uint64_t count = r.u64("array count");
  if (count > r.remaining() / min_value_bytes(element))
    r.fail("array of " + str(count) + " " + type_name(element) + " items cannot fit in the " +
           str(r.remaining()) + " bytes left in the file");
  if (count > items_left)
    r.fail("array of " + str(count) + " items exceeds the limit of " + str(kMaxArrayItems) +
           " metadata array items per file");
  items_left -= count;
  auto array = std::make_shared<GgufArray>();
  array->element_type = element;
  array->items.reserve(count);
  r.indices().push_back(0);
  for (std::uint64_t i = 0; i < count; ++i) {
    r.indices().back() = i;
    array->items.push_back(read_value(r, element, depth, items_left));
  }
  r.indices().pop_back();
  return array;
}

// The value as integer type T, if it is an integer and T's range holds it.
template <class T>
bool integer_as(const GgufValue& v, T& out) {
  if (const auto* u = std::get_if<std::uint64_t>(&v.v)) {
    if (!std::in_range<T>(*u)) return false;
    out = static_cast<T>(*u);
    return true;
  }
  if (const auto* s = std::get_if<std::int64_t>(&v.v)) {
    if (!std::in_range<T>(*s)) return false;
    out = static_cast<T>(*s);
    return true;
  }
  return false;
}

bool is_integer_type(GgufType t) {
  return fixed_width(t) > 0 && t != GgufType::BOOL && t != GgufType::FLOAT32 && t != GgufType::FLOAT64;
}

std::string integer_text(const GgufValue& v) {
  if (const auto* u = std::get_if<std::uint64_t>(&v.v)) return str(*u);
  if (const auto* s = std::get_if<std::int64_t>(&v.v)) return std::to_string(*s);
  return "?";
}

// The file's bytes: a read-only mapping (open) or an aligned heap copy of exactly the input's
// size (from_bytes), so that AddressSanitizer catches any read past the end while fuzzing.
class Storage {
 public:
  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() { release(); }

  void map(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw GgufError(path + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      throw GgufError(path + ": cannot stat: " + std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw GgufError(path + ": not a regular file");
    }
    if (st.st_size > 0) {
      void* p = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        throw GgufError(path + ": cannot map: " + std::strerror(err));
      }
      data_ = static_cast<std::uint8_t*>(p);
      size_ = static_cast<std::size_t>(st.st_size);
      mapped_ = true;
    }
    ::close(fd);  // the mapping keeps the file alive
  }

  void copy(std::span<const std::uint8_t> bytes) {
    if (bytes.empty()) return;
    data_ = static_cast<std::uint8_t*>(::operator new(bytes.size(), std::align_val_t{kCopyAlignment}));
    size_ = bytes.size();
    std::memcpy(data_, bytes.data(), bytes.size());
  }

  std::span<const std::uint8_t> bytes() const { return {data_, size_}; }

 private:
  void release() {
    if (!data_) return;
    if (mapped_)
      ::munmap(data_, size_);
    else
      ::operator delete(data_, std::align_val_t{kCopyAlignment});
  }

  std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  bool mapped_ = false;
};

}  // namespace

std::int64_t GgufTensorInfo::elements() const {
  std::int64_t n = 1;
  for (std::int64_t d : ne) n *= d;
  return n;
}

struct GgufFile::Impl {
  std::string path;
  Storage storage;
  std::uint32_t version = 0;
  std::uint64_t alignment = kDefaultAlignment;
  std::uint64_t data_offset = 0;  // file offset of the data section
  std::vector<std::pair<std::string, GgufValue>> metadata;
  std::map<std::string, std::size_t, std::less<>> key_index;
  std::vector<GgufTensorInfo> tensors;
  std::map<std::string, std::size_t, std::less<>> tensor_index;

  void parse();
  void parse_metadata(Reader& r, std::uint64_t n_kv);
  void parse_alignment();
  void parse_tensor_infos(Reader& r, std::uint64_t n_tensors);
  void check_tensor_data();

  const GgufValue& value(std::string_view key) const {
    const auto it = key_index.find(key);
    if (it == key_index.end()) throw GgufError("metadata key " + quote(key) + " is missing");
    return metadata[it->second].second;
  }
  [[noreturn]] static void wrong_type(std::string_view key, const GgufValue& v, const char* expected) {
    throw GgufError("metadata key " + quote(key) + " has type " + describe(v) + ", expected " + expected);
  }
  template <class T>
  T integer(std::string_view key, const char* expected) const {
    const GgufValue& v = value(key);
    T out{};
    if (integer_as(v, out)) return out;
    if (!is_integer_type(v.type)) wrong_type(key, v, "an integer");
    throw GgufError("metadata key " + quote(key) + ": value " + integer_text(v) + " does not fit in " + expected);
  }
  const GgufArray& array(std::string_view key, const char* expected) const {
    const GgufValue& v = value(key);
    const auto* a = std::get_if<std::shared_ptr<GgufArray>>(&v.v);
    if (!a || !*a) wrong_type(key, v, expected);
    return **a;
  }
};

void GgufFile::Impl::parse() {
  const std::span<const std::uint8_t> bytes = storage.bytes();
  Reader r(bytes);
  r.set_context("header");
  if (bytes.size() < 4) r.fail("file of " + str(bytes.size()) + " bytes is too small to hold the GGUF magic");
  if (std::memcmp(bytes.data(), "GGUF", 4) != 0) {
    char hex[32];
    std::snprintf(hex, sizeof hex, "%02x %02x %02x %02x", bytes[0], bytes[1], bytes[2], bytes[3]);
    r.fail(std::string("bad magic ") + hex + " (expected 'GGUF' = 47 47 55 46)");
  }
  r.uint(4, "magic");
  version = r.u32("version");
  if (version == 1) r.fail("GGUF version 1 (32-bit counts) is not supported; supported versions are 2 and 3");
  if (version != 2 && version != 3) {
    const std::uint32_t swapped =
        (version >> 24) | ((version >> 8) & 0xff00) | ((version << 8) & 0xff0000) | (version << 24);
    r.fail("unsupported GGUF version " + str(version) + " (supported: 2 and 3)" +
           (swapped == 2 || swapped == 3 ? "; the file looks big-endian, which is not supported" : ""));
  }
  const std::uint64_t n_tensors = r.u64("tensor count");
  const std::uint64_t n_kv = r.u64("metadata count");
  // The smallest metadata entry is 13 bytes (empty key, type, one byte), the smallest tensor info
  // 32 (empty name, n_dims, one ne, type, offset): a bogus count fails here, not in reserve().
  if (n_kv > r.remaining() / 13)
    r.fail("metadata count " + str(n_kv) + " cannot fit in the " + str(r.remaining()) + " bytes left in the file");
  if (n_tensors > r.remaining() / 32)
    r.fail("tensor count " + str(n_tensors) + " cannot fit in the " + str(r.remaining()) +
           " bytes left in the file");
  parse_metadata(r, n_kv);
  parse_alignment();
  parse_tensor_infos(r, n_tensors);

  // The data section starts at the aligned end of the header; alignment <= 2^31 and the header
  // lies inside the file, so this cannot overflow.
  const std::uint64_t header_end = r.pos();
  data_offset = (header_end + alignment - 1) / alignment * alignment;
  check_tensor_data();
}

void GgufFile::Impl::parse_metadata(Reader& r, std::uint64_t n_kv) {
  std::uint64_t items_left = kMaxArrayItems;
  metadata.reserve(n_kv);
  for (std::uint64_t i = 0; i < n_kv; ++i) {
    r.set_context("metadata entry " + str(i));
    std::string key = r.string("key");
    if (key.empty()) r.fail("empty key");
    r.set_context("metadata key " + quote(key));
    if (const auto it = key_index.find(key); it != key_index.end())
      r.fail("duplicate key (first defined by metadata entry " + str(it->second) + ")");
    const std::uint32_t raw = r.u32("value type");
    if (raw > kLastType) r.fail("unknown value type " + str(raw));
    GgufValue v = read_value(r, static_cast<GgufType>(raw), 0, items_left);
    key_index.emplace(key, metadata.size());
    metadata.emplace_back(std::move(key), std::move(v));
  }
}

void GgufFile::Impl::parse_alignment() {
  constexpr std::string_view kKey = "general.alignment";
  const auto it = key_index.find(kKey);
  if (it == key_index.end()) return;
  const GgufValue& v = metadata[it->second].second;
  if (v.type != GgufType::UINT32) wrong_type(kKey, v, "UINT32");
  alignment = std::get<std::uint64_t>(v.v);
  if (!std::has_single_bit(alignment))
    throw GgufError("metadata key " + quote(kKey) + ": " + str(alignment) + " is not a non-zero power of two");
}

void GgufFile::Impl::parse_tensor_infos(Reader& r, std::uint64_t n_tensors) {
  tensors.reserve(n_tensors);
  for (std::uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    r.set_context("tensor " + str(i));
    t.name = r.string("name");
    if (t.name.empty()) r.fail("empty name");
    r.set_context("tensor " + quote(t.name));
    if (const auto it = tensor_index.find(t.name); it != tensor_index.end())
      r.fail("duplicate tensor name (first used by tensor " + str(it->second) + ")");

    const std::uint32_t n_dims = r.u32("n_dims");
    if (n_dims == 0 || n_dims > kMaxDims)
      r.fail("n_dims " + str(n_dims) + " is out of range (1 to " + str(kMaxDims) + ")");
    std::int64_t elements = 1;
    for (std::uint32_t j = 0; j < n_dims; ++j) {
      const std::string what = "ne[" + str(j) + "]";
      const auto d = static_cast<std::int64_t>(r.u64(what.c_str()));
      if (d <= 0) r.fail(what + " = " + std::to_string(d) + " is not positive");
      if (elements > std::numeric_limits<std::int64_t>::max() / d)
        r.fail("element count overflows int64 at " + what + " = " + std::to_string(d));
      elements *= d;
      t.ne.push_back(d);
    }

    const std::uint32_t type_id = r.u32("type");
    const formats::GgmlTypeInfo* info = formats::ggml_type_info(type_id);
    if (!info) r.fail("unknown tensor type id " + str(type_id));
    t.type = info->type;
    if (t.ne[0] % info->block_size != 0)
      r.fail("ne[0] = " + std::to_string(t.ne[0]) + " is not a multiple of the " + info->name + " block size " +
             std::to_string(info->block_size));
    // ne[0] is a whole number of blocks, so elements is too.
    const auto blocks = static_cast<std::uint64_t>(elements / info->block_size);
    if (blocks > std::numeric_limits<std::uint64_t>::max() / info->block_bytes)
      r.fail("data size (" + str(blocks) + " blocks of " + str(info->block_bytes) + " bytes) overflows 64 bits");
    t.bytes = blocks * info->block_bytes;

    t.offset = r.u64("data offset");
    if (t.offset % alignment != 0)
      r.fail("data offset " + str(t.offset) + " is not a multiple of the alignment " + str(alignment));
    tensor_index.emplace(t.name, tensors.size());
    tensors.push_back(std::move(t));
  }
}

void GgufFile::Impl::check_tensor_data() {
  if (tensors.empty()) return;  // a file without tensors needs no data section
  const std::uint64_t size = storage.bytes().size();
  if (data_offset > size)
    throw GgufError("data section starts at offset " + str(data_offset) + ", past the end of the file (size " +
                    str(size) + ")");
  const std::uint64_t data_size = size - data_offset;
  for (const GgufTensorInfo& t : tensors)
    if (t.offset > data_size || t.bytes > data_size - t.offset)
      throw GgufError("tensor " + quote(t.name) + ": data [offset " + str(t.offset) + ", " + str(t.bytes) +
                      " bytes] extends past the end of the file (data section at " + str(data_offset) +
                      ", file size " + str(size) + ")");
  std::vector<const GgufTensorInfo*> by_offset;
  for (const GgufTensorInfo& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensorInfo& a = *by_offset[i - 1];
    const GgufTensorInfo& b = *by_offset[i];
    if (a.offset + a.bytes > b.offset)  // both lie inside the file: no overflow
      throw GgufError("tensors " + quote(a.name) + " [offset " + str(a.offset) + ", " + str(a.bytes) +
                      " bytes] and " + quote(b.name) + " [offset " + str(b.offset) + "] overlap");
  }
}

GgufFile::GgufFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

GgufFile GgufFile::open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->storage.map(path);
  try {
    impl->parse();
  } catch (const GgufError& e) {
    throw GgufError(path + ": " + e.what());
  }
  return GgufFile(std::move(impl));
}

GgufFile GgufFile::from_bytes(std::span<const std::uint8_t> bytes) {
  auto impl = std::make_unique<Impl>();
  impl->storage.copy(bytes);
  impl->parse();
  return GgufFile(std::move(impl));
}

std::uint32_t GgufFile::version() const { return impl_->version; }
std::uint64_t GgufFile::alignment() const { return impl_->alignment; }
const std::string& GgufFile::path() const { return impl_->path; }

const std::vector<std::pair<std::string, GgufValue>>& GgufFile::metadata() const { return impl_->metadata; }

const GgufValue* GgufFile::find(std::string_view key) const {
  const auto it = impl_->key_index.find(key);
  return it == impl_->key_index.end() ? nullptr : &impl_->metadata[it->second].second;
}

std::uint64_t GgufFile::get_u64(std::string_view key) const { return impl_->integer<std::uint64_t>(key, "UINT64"); }
std::uint32_t GgufFile::get_u32(std::string_view key) const { return impl_->integer<std::uint32_t>(key, "UINT32"); }
std::int64_t GgufFile::get_i64(std::string_view key) const { return impl_->integer<std::int64_t>(key, "INT64"); }

double GgufFile::get_f64(std::string_view key) const {
  const GgufValue& v = impl_->value(key);
  const auto* d = std::get_if<double>(&v.v);
  if (!d) Impl::wrong_type(key, v, "FLOAT32 or FLOAT64");
  return *d;
}

bool GgufFile::get_bool(std::string_view key) const {
  const GgufValue& v = impl_->value(key);
  const auto* b = std::get_if<bool>(&v.v);
  if (!b) Impl::wrong_type(key, v, "BOOL");
  return *b;
}

const std::string& GgufFile::get_string(std::string_view key) const {
  const GgufValue& v = impl_->value(key);
  const auto* s = std::get_if<std::string>(&v.v);
  if (!s) Impl::wrong_type(key, v, "STRING");
  return *s;
}

std::vector<std::string> GgufFile::get_string_array(std::string_view key) const {
  const GgufArray& a = impl_->array(key, "ARRAY of STRING");
  if (a.element_type != GgufType::STRING) Impl::wrong_type(key, impl_->value(key), "ARRAY of STRING");
  std::vector<std::string> out;
  out.reserve(a.items.size());
  for (const GgufValue& item : a.items) out.push_back(std::get<std::string>(item.v));
  return out;
}

std::vector<std::int64_t> GgufFile::get_int_array(std::string_view key) const {
  const GgufArray& a = impl_->array(key, "ARRAY of an integer type");
  if (!is_integer_type(a.element_type)) Impl::wrong_type(key, impl_->value(key), "ARRAY of an integer type");
  std::vector<std::int64_t> out;
  out.reserve(a.items.size());
  for (std::size_t i = 0; i < a.items.size(); ++i) {
    std::int64_t x = 0;
    if (!integer_as(a.items[i], x))
      throw GgufError("metadata key " + quote(key) + "[" + str(i) + "]: value " + integer_text(a.items[i]) +
                      " does not fit in INT64");
    out.push_back(x);
  }
  return out;
}

std::vector<double> GgufFile::get_f64_array(std::string_view key) const {
  const GgufArray& a = impl_->array(key, "ARRAY of FLOAT32 or FLOAT64");
  if (a.element_type != GgufType::FLOAT32 && a.element_type != GgufType::FLOAT64)
    Impl::wrong_type(key, impl_->value(key), "ARRAY of FLOAT32 or FLOAT64");
  std::vector<double> out;
  out.reserve(a.items.size());
  for (const GgufValue& item : a.items) out.push_back(std::get<double>(item.v));
  return out;
}

std::uint32_t GgufFile::get_u32_or(std::string_view key, std::uint32_t fallback) const {
  return find(key) ? get_u32(key) : fallback;
}
double GgufFile::get_f64_or(std::string_view key, double fallback) const {
  return find(key) ? get_f64(key) : fallback;
}
bool GgufFile::get_bool_or(std::string_view key, bool fallback) const {
  return find(key) ? get_bool(key) : fallback;
}
std::string GgufFile::get_string_or(std::string_view key, std::string fallback) const {
  return find(key) ? get_string(key) : std::move(fallback);
}

const std::vector<GgufTensorInfo>& GgufFile::tensors() const { return impl_->tensors; }

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  const auto it = impl_->tensor_index.find(name);
  return it == impl_->tensor_index.end() ? nullptr : &impl_->tensors[it->second];
}

const GgufTensorInfo& GgufFile::tensor(std::string_view name) const {
  const GgufTensorInfo* t = find_tensor(name);
  if (!t) throw GgufError("no tensor named " + quote(name));
  return *t;
}

std::span<const std::uint8_t> GgufFile::tensor_data(const GgufTensorInfo& t) const {
  // t may be a copy, or come from another file: check it against this one.
  const std::span<const std::uint8_t> bytes = impl_->storage.bytes();
  const std::uint64_t data_size = bytes.size() - std::min<std::uint64_t>(bytes.size(), impl_->data_offset);
  if (t.offset > data_size || t.bytes > data_size - t.offset)
    throw GgufError("tensor " + quote(t.name) + ": data [offset " + str(t.offset) + ", " + str(t.bytes) +
                    " bytes] lies outside this file's data section");
  return bytes.subspan(impl_->data_offset + t.offset, t.bytes);
}

// ---- writer ----

namespace {

class Sink {
 public:
  explicit Sink(std::vector<std::uint8_t>& out) : out_(out) {}
  void uint(std::uint64_t v, int width) {
    for (int i = 0; i < width; ++i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  void string(std::string_view s) {
    uint(s.size(), 8);
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void pad(std::uint64_t alignment) {
    while (out_.size() % alignment != 0) out_.push_back(0);
  }

 private:
  std::vector<std::uint8_t>& out_;
};

// The field bits of an integer value of type t, checked against the field's range.
std::uint64_t integer_bits(const GgufValue& v) {
  const int width = fixed_width(v.type);
  const int bits = 8 * width;
  if (is_signed(v.type)) {
    std::int64_t x = 0;
    const std::int64_t hi = static_cast<std::int64_t>(std::numeric_limits<std::uint64_t>::max() >> (65 - bits));
    const std::int64_t lo = -hi - 1;
    if (!integer_as(v, x) || x < lo || x > hi)
      throw std::invalid_argument(std::string("GgufWriter: value does not fit ") + type_name(v.type));
    return static_cast<std::uint64_t>(x);
  }
  std::uint64_t x = 0;
  const std::uint64_t hi = std::numeric_limits<std::uint64_t>::max() >> (64 - bits);
  if (!integer_as(v, x) || x > hi)
    throw std::invalid_argument(std::string("GgufWriter: value does not fit ") + type_name(v.type));
  return x;
}

template <class T>
const T& held(const GgufValue& v) {
  const T* x = std::get_if<T>(&v.v);
  if (!x) throw std::invalid_argument(std::string("GgufWriter: value of type ") + type_name(v.type) +
                                      " holds the wrong C++ type");
  return *x;
}

void write_value(Sink& s, const GgufValue& v) {
  switch (v.type) {
    case GgufType::UINT8:
    case GgufType::INT8:
    case GgufType::UINT16:
    case GgufType::INT16:
    case GgufType::UINT32:
    case GgufType::INT32:
    case GgufType::UINT64:
    case GgufType::INT64: s.uint(integer_bits(v), fixed_width(v.type)); return;
    case GgufType::FLOAT32: s.uint(std::bit_cast<std::uint32_t>(static_cast<float>(held<double>(v))), 4); return;
    case GgufType::FLOAT64: s.uint(std::bit_cast<std::uint64_t>(held<double>(v)), 8); return;
    case GgufType::BOOL: s.uint(held<bool>(v) ? 1 : 0, 1); return;
    case GgufType::STRING: s.string(held<std::string>(v)); return;
    case GgufType::ARRAY: {
      const auto& a = held<std::shared_ptr<GgufArray>>(v);
      if (!a) throw std::invalid_argument("GgufWriter: null array");
      s.uint(static_cast<std::uint32_t>(a->element_type), 4);
      s.uint(a->items.size(), 8);
      for (const GgufValue& item : a->items) {
        if (item.type != a->element_type)
          throw std::invalid_argument(std::string("GgufWriter: ") + type_name(item.type) + " item in an array of " +
                                      type_name(a->element_type));
        write_value(s, item);
      }
      return;
    }
  }
  throw std::invalid_argument("GgufWriter: unknown value type " + str(static_cast<std::uint32_t>(v.type)));
}

template <class T, class Item>
GgufValue array_of(GgufType element, const std::vector<Item>& items) {
  auto a = std::make_shared<GgufArray>();
  a->element_type = element;
  for (const Item& x : items) a->items.push_back({element, T(x)});
  return {GgufType::ARRAY, std::move(a)};
}

}  // namespace

void GgufWriter::add(std::string key, GgufValue value) { kv_.emplace_back(std::move(key), std::move(value)); }
void GgufWriter::add_u32(std::string key, std::uint32_t v) {
  add(std::move(key), {GgufType::UINT32, std::uint64_t{v}});
}
void GgufWriter::add_f32(std::string key, float v) { add(std::move(key), {GgufType::FLOAT32, double{v}}); }
void GgufWriter::add_bool(std::string key, bool v) { add(std::move(key), {GgufType::BOOL, v}); }
void GgufWriter::add_string(std::string key, std::string v) { add(std::move(key), {GgufType::STRING, std::move(v)}); }

void GgufWriter::add_string_array(std::string key, const std::vector<std::string>& v) {
  add(std::move(key), array_of<std::string>(GgufType::STRING, v));
}
void GgufWriter::add_i32_array(std::string key, const std::vector<std::int32_t>& v) {
  add(std::move(key), array_of<std::int64_t>(GgufType::INT32, v));
}
void GgufWriter::add_f32_array(std::string key, const std::vector<float>& v) {
  add(std::move(key), array_of<double>(GgufType::FLOAT32, v));
}

void GgufWriter::add_tensor(std::string name, std::vector<std::int64_t> ne, formats::GgmlType type,
                            std::vector<std::uint8_t> data) {
  if (ne.empty() || ne.size() > kMaxDims)
    throw std::invalid_argument("GgufWriter: tensor '" + name + "' needs 1 to 4 dimensions");
  std::size_t bytes = formats::ggml_row_bytes(type, ne[0]);
  for (std::size_t j = 1; j < ne.size(); ++j) {
    if (ne[j] <= 0) throw std::invalid_argument("GgufWriter: tensor '" + name + "' has a non-positive dimension");
    bytes *= static_cast<std::size_t>(ne[j]);
  }
  if (ne[0] <= 0 || data.size() != bytes)
    throw std::invalid_argument("GgufWriter: tensor '" + name + "' has " + str(data.size()) +
                                " data bytes, its shape needs " + str(bytes));
  tensors_.push_back({std::move(name), std::move(ne), type, std::move(data)});
}

void GgufWriter::add_f32_tensor(std::string name, std::vector<std::int64_t> ne, const std::vector<float>& data) {
  std::vector<std::uint8_t> bytes;
  Sink s(bytes);
  for (float x : data) s.uint(std::bit_cast<std::uint32_t>(x), 4);
  add_tensor(std::move(name), std::move(ne), formats::GgmlType::F32, std::move(bytes));
}

void GgufWriter::set_alignment(std::uint32_t alignment) {
  if (!std::has_single_bit(alignment))
    throw std::invalid_argument("GgufWriter: alignment " + str(alignment) + " is not a non-zero power of two");
  alignment_ = alignment;
}

std::vector<std::uint8_t> GgufWriter::bytes() const {
  const bool write_alignment = alignment_ != kDefaultAlignment;
  std::vector<std::uint8_t> out;
  Sink s(out);
  out = {'G', 'G', 'U', 'F'};
  s.uint(3, 4);
  s.uint(tensors_.size(), 8);
  s.uint(kv_.size() + (write_alignment ? 1 : 0), 8);
  if (write_alignment) {
    s.string("general.alignment");
    s.uint(static_cast<std::uint32_t>(GgufType::UINT32), 4);
    s.uint(alignment_, 4);
  }
  for (const auto& [key, value] : kv_) {
    s.string(key);
    s.uint(static_cast<std::uint32_t>(value.type), 4);
    write_value(s, value);
  }
  std::uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    s.string(t.name);
    s.uint(t.ne.size(), 4);
    for (std::int64_t d : t.ne) s.uint(static_cast<std::uint64_t>(d), 8);
    s.uint(static_cast<std::uint32_t>(t.type), 4);
    s.uint(offset, 8);
    offset = (offset + t.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  // No padding after the last tensor: it would align nothing.
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    s.pad(alignment_);
    out.insert(out.end(), tensors_[i].data.begin(), tensors_[i].data.end());
  }
  return out;
}

void GgufWriter::write(const std::string& path) const {
  const std::vector<std::uint8_t> b = bytes();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  f.close();
  if (!f) throw GgufError(path + ": cannot write");
}

}  // namespace witcert::model
