#include "model/gguf.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace witcert::model {
namespace {

using formats::GgmlType;

const std::string kModel = std::string(WITCERT_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

// Writes GGUF fields one at a time, so a test can put any value anywhere.
struct Raw {
  std::vector<std::uint8_t> b;

  Raw& u8(std::uint8_t v) {
    b.push_back(v);
    return *this;
  }
  Raw& u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
    return *this;
  }
  Raw& u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
    return *this;
  }
  Raw& str(std::string_view s) {
    u64(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Raw& header(std::uint64_t n_tensors, std::uint64_t n_kv, std::uint32_t version = 3) {
    b = {'G', 'G', 'U', 'F'};
    return u32(version).u64(n_tensors).u64(n_kv);
  }
  Raw& kv_u32(std::string_view key, std::uint32_t v) { return str(key).u32(4).u32(v); }
  Raw& tensor(std::string_view name, std::vector<std::uint64_t> ne, GgmlType type, std::uint64_t offset) {
    str(name).u32(static_cast<std::uint32_t>(ne.size()));
    for (std::uint64_t d : ne) u64(d);
    return u32(static_cast<std::uint32_t>(type)).u64(offset);
  }
  Raw& pad(std::size_t alignment = 32) {
    while (b.size() % alignment != 0) b.push_back(0);
    return *this;
  }
  Raw& zeros(std::size_t n) {
    b.insert(b.end(), n, 0);
    return *this;
  }
};

// The GgufError message of parsing bytes; a test failure if parsing succeeds or throws anything else.
std::string error_of(const std::vector<std::uint8_t>& bytes) {
  try {
    GgufFile::from_bytes(bytes);
  } catch (const GgufError& e) {
    return e.what();
  }
  ADD_FAILURE() << "parsed without a GgufError";
  return "";
}

// A malformed file must be rejected with a message that names what is wrong.
void expect_rejected(const std::vector<std::uint8_t>& bytes, std::initializer_list<std::string_view> mentions) {
  const std::string msg = error_of(bytes);
  for (std::string_view m : mentions) EXPECT_NE(msg.find(m), std::string::npos) << "'" << m << "' not in: " << msg;
}

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> out(n);
  for (std::uint8_t& x : out) x = static_cast<std::uint8_t>(rng());
  return out;
}

std::string temp_path(const std::string& name) {
  return testing::TempDir() + "witcert_gguf_" + std::to_string(::getpid()) + "_" + name;
}

void write_file(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

GgufValue array(GgufType element, std::vector<GgufValue> items) {
  auto a = std::make_shared<GgufArray>();
  a->element_type = element;
  a->items = std::move(items);
  return {GgufType::ARRAY, std::move(a)};
}

// A small model with metadata of several kinds and three tensors: the base of the truncation
// and corruption tests.
GgufWriter small_model() {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", 2);
  w.add_f32("llama.rope.freq_base", 10000.0f);
  w.add_bool("tokenizer.ggml.add_bos_token", true);
  w.add_string_array("tokenizer.ggml.tokens", {"<s>", "a", "b"});
  w.add_i32_array("tokenizer.ggml.token_type", {3, 1, 1});
  w.add("nested", array(GgufType::ARRAY, {array(GgufType::INT16, {{GgufType::INT16, std::int64_t{-2}}})}));
  w.add_f32_tensor("norm.weight", {4}, {1.0f, 2.0f, 3.0f, 4.0f});
  w.add_tensor("token_embd.weight", {32, 3}, GgmlType::Q8_0, random_bytes(34 * 3, 1));
  w.add_tensor("output.weight", {32, 1}, GgmlType::Q4_1, random_bytes(20, 2));
  return w;
}

// ---- round trips ----

TEST(GgufRoundTrip, EveryValueType) {
  const std::string invalid_utf8("\xff\xfe\0bytes", 8);  // GGUF strings are bytes: kept as they are
  GgufWriter w;
  w.add("u8", {GgufType::UINT8, std::uint64_t{255}});
  w.add("i8", {GgufType::INT8, std::int64_t{-128}});
  w.add("u16", {GgufType::UINT16, std::uint64_t{65535}});
  w.add("i16", {GgufType::INT16, std::int64_t{-32768}});
  w.add("u32", {GgufType::UINT32, std::uint64_t{4294967295u}});
  w.add("i32", {GgufType::INT32, std::int64_t{-2147483647 - 1}});
  w.add("u64", {GgufType::UINT64, std::numeric_limits<std::uint64_t>::max()});
  w.add("i64", {GgufType::INT64, std::numeric_limits<std::int64_t>::min()});
  w.add("f32", {GgufType::FLOAT32, 1.5});
  w.add("f64", {GgufType::FLOAT64, 3.141592653589793});
  w.add("t", {GgufType::BOOL, true});
  w.add("f", {GgufType::BOOL, false});
  w.add("s", {GgufType::STRING, invalid_utf8});
  w.add("empty_string", {GgufType::STRING, std::string()});
  w.add("bools", array(GgufType::BOOL, {{GgufType::BOOL, true}, {GgufType::BOOL, false}}));
  w.add("empty", array(GgufType::UINT8, {}));
  w.add("matrix",
        array(GgufType::ARRAY,
              {array(GgufType::INT16, {{GgufType::INT16, std::int64_t{-7}}}), array(GgufType::INT16, {}),
               array(GgufType::INT16, {{GgufType::INT16, std::int64_t{1}}, {GgufType::INT16, std::int64_t{2}}})}));
  w.add("deep", array(GgufType::ARRAY,
                      {array(GgufType::ARRAY, {array(GgufType::STRING, {{GgufType::STRING, std::string("x")}})})}));
  w.add_string_array("strings", {"a", "", "ccc"});
  w.add_i32_array("ints", {-1, 0, 7});
  w.add_f32_array("floats", {0.25f, -2.0f});
  w.add("u64s", array(GgufType::UINT64, {{GgufType::UINT64, std::uint64_t{1} << 40}}));
  w.add("f64s", array(GgufType::FLOAT64, {{GgufType::FLOAT64, 1e300}}));

  const GgufFile f = GgufFile::from_bytes(w.bytes());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.path(), "");
  ASSERT_EQ(f.metadata().size(), 23u);
  EXPECT_EQ(f.metadata()[0].first, "u8");  // file order
  EXPECT_EQ(f.metadata()[22].first, "f64s");

  EXPECT_EQ(f.get_u32("u8"), 255u);
  EXPECT_EQ(f.get_i64("i8"), -128);
  EXPECT_EQ(f.get_u64("u16"), 65535u);
  EXPECT_EQ(f.get_i64("i16"), -32768);
  EXPECT_EQ(f.get_u32("u32"), 4294967295u);
  EXPECT_EQ(f.get_i64("i32"), -2147483648ll);
  EXPECT_EQ(f.get_u64("u64"), std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(f.get_i64("i64"), std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(f.get_f64("f32"), 1.5);
  EXPECT_EQ(f.get_f64("f64"), 3.141592653589793);
  EXPECT_TRUE(f.get_bool("t"));
  EXPECT_FALSE(f.get_bool("f"));
  EXPECT_EQ(f.get_string("s"), invalid_utf8);
  EXPECT_EQ(f.get_string("empty_string"), "");
  const std::vector<GgufType> types = {GgufType::UINT8,   GgufType::INT8,    GgufType::UINT16, GgufType::INT16,
                                       GgufType::UINT32,  GgufType::INT32,   GgufType::UINT64, GgufType::INT64,
                                       GgufType::FLOAT32, GgufType::FLOAT64, GgufType::BOOL,   GgufType::BOOL,
                                       GgufType::STRING,  GgufType::STRING};
  for (std::size_t i = 0; i < types.size(); ++i) EXPECT_EQ(f.metadata()[i].second.type, types[i]) << i;
  for (std::size_t i = types.size(); i < f.metadata().size(); ++i)
    EXPECT_EQ(f.metadata()[i].second.type, GgufType::ARRAY) << i;
  EXPECT_EQ(f.find("missing"), nullptr);

  const auto& bools = *std::get<std::shared_ptr<GgufArray>>(f.find("bools")->v);
  EXPECT_EQ(bools.element_type, GgufType::BOOL);
  ASSERT_EQ(bools.items.size(), 2u);
  EXPECT_TRUE(std::get<bool>(bools.items[0].v));
  EXPECT_FALSE(std::get<bool>(bools.items[1].v));
  EXPECT_TRUE(std::get<std::shared_ptr<GgufArray>>(f.find("empty")->v)->items.empty());

  const auto& matrix = *std::get<std::shared_ptr<GgufArray>>(f.find("matrix")->v);
  EXPECT_EQ(matrix.element_type, GgufType::ARRAY);
  ASSERT_EQ(matrix.items.size(), 3u);
  const auto& row0 = *std::get<std::shared_ptr<GgufArray>>(matrix.items[0].v);
  EXPECT_EQ(row0.element_type, GgufType::INT16);
  EXPECT_EQ(std::get<std::int64_t>(row0.items.at(0).v), -7);
  EXPECT_TRUE(std::get<std::shared_ptr<GgufArray>>(matrix.items[1].v)->items.empty());
  EXPECT_EQ(std::get<std::shared_ptr<GgufArray>>(matrix.items[2].v)->items.size(), 2u);
  const auto& deep = *std::get<std::shared_ptr<GgufArray>>(f.find("deep")->v);
  const auto& deep1 = *std::get<std::shared_ptr<GgufArray>>(deep.items.at(0).v);
  const auto& deep2 = *std::get<std::shared_ptr<GgufArray>>(deep1.items.at(0).v);
  EXPECT_EQ(std::get<std::string>(deep2.items.at(0).v), "x");

  EXPECT_EQ(f.get_string_array("strings"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(f.get_int_array("ints"), (std::vector<std::int64_t>{-1, 0, 7}));
  EXPECT_EQ(f.get_int_array("u64s"), (std::vector<std::int64_t>{std::int64_t{1} << 40}));
  EXPECT_EQ(f.get_f64_array("floats"), (std::vector<double>{0.25, -2.0}));
  EXPECT_EQ(f.get_f64_array("f64s"), (std::vector<double>{1e300}));
  EXPECT_TRUE(f.tensors().empty());
}

TEST(GgufRoundTrip, SpecialFloatsKeepTheirBits) {
  GgufWriter w;
  w.add_f32("inf", INFINITY);
  w.add_f32("nan", NAN);
  w.add_f32("neg_zero", -0.0f);
  w.add_f32("denormal", 1e-45f);
  const GgufFile f = GgufFile::from_bytes(w.bytes());
  EXPECT_EQ(f.get_f64("inf"), INFINITY);
  EXPECT_TRUE(std::isnan(f.get_f64("nan")));
  EXPECT_TRUE(std::signbit(f.get_f64("neg_zero")));
  EXPECT_EQ(static_cast<float>(f.get_f64("denormal")), 1e-45f);
}

TEST(GgufRoundTrip, TensorsOfSeveralTypesThroughAFile) {
  struct Case {
    std::string name;
    std::vector<std::int64_t> ne;
    GgmlType type;
    std::size_t bytes;
  };
  const std::vector<Case> cases = {
      {"f32", {5}, GgmlType::F32, 20},
      {"f16", {3, 2}, GgmlType::F16, 12},
      {"bf16", {1, 1, 1, 7}, GgmlType::BF16, 14},
      {"q8_0", {64, 3}, GgmlType::Q8_0, 2 * 34 * 3},
      {"q4_0", {32, 2, 2}, GgmlType::Q4_0, 18 * 4},
      {"q4_1", {96}, GgmlType::Q4_1, 3 * 20},
      {"q5_1", {32}, GgmlType::Q5_1, 24},
      {"q4_k", {256, 2}, GgmlType::Q4_K, 2 * 144},
      {"q6_k", {512}, GgmlType::Q6_K, 2 * 210},
      {"i32", {3}, GgmlType::I32, 12},
  };
  GgufWriter w;
  w.add_u32("general.quantization_version", 2);
  for (std::size_t i = 0; i < cases.size(); ++i)
    w.add_tensor(cases[i].name, cases[i].ne, cases[i].type, random_bytes(cases[i].bytes, i));
  const std::string path = temp_path("tensors.gguf");
  w.write(path);
  const GgufFile f = GgufFile::open(path);
  std::filesystem::remove(path);  // the mapping keeps the data readable
  EXPECT_EQ(f.path(), path);
  ASSERT_EQ(f.tensors().size(), cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const GgufTensorInfo& t = f.tensors()[i];
    SCOPED_TRACE(cases[i].name);
    EXPECT_EQ(t.name, cases[i].name);
    EXPECT_EQ(t.ne, cases[i].ne);
    EXPECT_EQ(t.type, cases[i].type);
    EXPECT_EQ(t.bytes, cases[i].bytes);
    EXPECT_EQ(t.offset % 32, 0u);
    EXPECT_EQ(&f.tensor(cases[i].name), &t);
    const std::span<const std::uint8_t> data = f.tensor_data(t);
    EXPECT_EQ(std::vector<std::uint8_t>(data.begin(), data.end()), random_bytes(cases[i].bytes, i));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(data.data()) % 32, 0u);  // mapped at a page boundary
  }
  EXPECT_EQ(f.tensor("q8_0").elements(), 192);
  EXPECT_EQ(f.tensor("bf16").elements(), 7);
  EXPECT_EQ(f.find_tensor("absent"), nullptr);
}

TEST(GgufRoundTrip, F32TensorValues) {
  GgufWriter w;
  w.add_f32_tensor("x", {2, 2}, {1.0f, -2.5f, 0.0f, 1e30f});
  const GgufFile f = GgufFile::from_bytes(w.bytes());
  const std::span<const std::uint8_t> data = f.tensor_data(f.tensor("x"));
  ASSERT_EQ(data.size(), 16u);
  float x[4];
  std::memcpy(x, data.data(), sizeof x);
  EXPECT_EQ(x[1], -2.5f);
  EXPECT_EQ(x[3], 1e30f);
}

TEST(GgufRoundTrip, Alignment) {
  for (std::uint32_t alignment : {1u, 8u, 32u, 64u, 4096u}) {
    SCOPED_TRACE(alignment);
    GgufWriter w;
    w.set_alignment(alignment);
    w.add_string("general.name", "aligned");
    w.add_f32_tensor("a", {3}, {1, 2, 3});
    w.add_f32_tensor("b", {5}, {1, 2, 3, 4, 5});
    const std::vector<std::uint8_t> bytes = w.bytes();
    const GgufFile f = GgufFile::from_bytes(bytes);
    EXPECT_EQ(f.alignment(), alignment);
    EXPECT_EQ(f.find("general.alignment") != nullptr, alignment != 32);  // 32 is the default
    const GgufTensorInfo& b = f.tensor("b");
    EXPECT_EQ(b.offset, (12 + alignment - 1) / alignment * alignment);
    // The file ends with b's 20 bytes, so the data section starts here; it must be aligned.
    const std::size_t data_start = bytes.size() - 20 - b.offset;
    EXPECT_EQ(data_start % alignment, 0u);
    EXPECT_EQ(f.tensor_data(f.tensor("a")).data() - f.tensor_data(b).data(), -static_cast<std::ptrdiff_t>(b.offset));
    float a0 = 0;
    std::memcpy(&a0, bytes.data() + data_start, 4);
    EXPECT_EQ(a0, 1.0f);
  }
  EXPECT_THROW(GgufWriter().set_alignment(0), std::invalid_argument);
  EXPECT_THROW(GgufWriter().set_alignment(48), std::invalid_argument);
}

TEST(GgufRoundTrip, Version2) {
  std::vector<std::uint8_t> bytes = small_model().bytes();
  bytes[4] = 2;  // v2 and v3 share a layout (v3 only allows big-endian files, which we reject)
  const GgufFile f = GgufFile::from_bytes(bytes);
  EXPECT_EQ(f.version(), 2u);
  EXPECT_EQ(f.tensors().size(), 3u);
}

TEST(GgufRoundTrip, NoTensorsNeedsNoDataSection) {
  GgufWriter w;
  w.add_string("general.architecture", "none");
  const std::vector<std::uint8_t> bytes = w.bytes();
  EXPECT_NE(bytes.size() % 32, 0u);
  EXPECT_TRUE(GgufFile::from_bytes(bytes).tensors().empty());
  EXPECT_TRUE(GgufFile::from_bytes(Raw().header(0, 0).b).metadata().empty());
}

TEST(GgufRoundTrip, WriterRejectsInconsistentInput) {
  GgufWriter w;
  EXPECT_THROW(w.add_tensor("t", {33}, GgmlType::Q4_0, std::vector<std::uint8_t>(18)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("t", {32}, GgmlType::Q4_0, std::vector<std::uint8_t>(17)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("t", {}, GgmlType::F32, {}), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("t", {1, 0}, GgmlType::F32, {}), std::invalid_argument);
  GgufWriter bad;
  bad.add("too_big", {GgufType::UINT8, std::uint64_t{256}});
  EXPECT_THROW(bad.bytes(), std::invalid_argument);
  GgufWriter mixed;
  mixed.add("mixed", array(GgufType::INT32, {{GgufType::STRING, std::string("x")}}));
  EXPECT_THROW(mixed.bytes(), std::invalid_argument);
  EXPECT_THROW(GgufWriter().write("/nonexistent-dir/x.gguf"), GgufError);
}

// ---- typed getters ----

TEST(GgufGetters, RangeAndTypeErrorsNameTheKey) {
  GgufWriter w;
  w.add("neg", {GgufType::INT8, std::int64_t{-1}});
  w.add("big", {GgufType::UINT64, std::uint64_t{1} << 40});
  w.add("huge", {GgufType::UINT64, std::numeric_limits<std::uint64_t>::max()});
  w.add_string("name", "x");
  w.add_f32("f", 2.0f);
  w.add_u32("n", 7);
  w.add_string_array("strs", {"a"});
  w.add("bigs", array(GgufType::UINT64, {{GgufType::UINT64, std::numeric_limits<std::uint64_t>::max()}}));
  const GgufFile f = GgufFile::from_bytes(w.bytes());
  auto message = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const GgufError& e) {
      return e.what();
    }
    return "no GgufError";
  };
  EXPECT_EQ(message([&] { f.get_u64("neg"); }), "metadata key 'neg': value -1 does not fit in UINT64");
  EXPECT_EQ(message([&] { f.get_u32("big"); }), "metadata key 'big': value 1099511627776 does not fit in UINT32");
  EXPECT_EQ(f.get_i64("big"), std::int64_t{1} << 40);
  EXPECT_EQ(message([&] { f.get_i64("huge"); }),
            "metadata key 'huge': value 18446744073709551615 does not fit in INT64");
  EXPECT_EQ(message([&] { f.get_u32("name"); }), "metadata key 'name' has type STRING, expected an integer");
  EXPECT_EQ(message([&] { f.get_u32("f"); }), "metadata key 'f' has type FLOAT32, expected an integer");
  EXPECT_EQ(message([&] { f.get_f64("n"); }), "metadata key 'n' has type UINT32, expected FLOAT32 or FLOAT64");
  EXPECT_EQ(message([&] { f.get_bool("n"); }), "metadata key 'n' has type UINT32, expected BOOL");
  EXPECT_EQ(message([&] { f.get_string("n"); }), "metadata key 'n' has type UINT32, expected STRING");
  EXPECT_EQ(message([&] { f.get_string("nope"); }), "metadata key 'nope' is missing");
  EXPECT_EQ(message([&] { f.get_int_array("strs"); }),
            "metadata key 'strs' has type ARRAY of STRING, expected ARRAY of an integer type");
  EXPECT_EQ(message([&] { f.get_f64_array("strs"); }),
            "metadata key 'strs' has type ARRAY of STRING, expected ARRAY of FLOAT32 or FLOAT64");
  EXPECT_EQ(message([&] { f.get_string_array("name"); }),
            "metadata key 'name' has type STRING, expected ARRAY of STRING");
  EXPECT_EQ(message([&] { f.get_int_array("bigs"); }),
            "metadata key 'bigs'[0]: value 18446744073709551615 does not fit in INT64");
  EXPECT_EQ(message([&] { f.tensor("w"); }), "no tensor named 'w'");

  EXPECT_EQ(f.get_u32_or("absent", 5), 5u);
  EXPECT_EQ(f.get_u32_or("n", 5), 7u);
  EXPECT_EQ(f.get_f64_or("absent", 0.5), 0.5);
  EXPECT_EQ(f.get_f64_or("f", 0.5), 2.0);
  EXPECT_TRUE(f.get_bool_or("absent", true));
  EXPECT_EQ(f.get_string_or("absent", "fallback"), "fallback");
  EXPECT_EQ(f.get_string_or("name", "fallback"), "x");
  // Present with the wrong type is an error, not the fallback.
  EXPECT_THROW(f.get_u32_or("name", 5), GgufError);
  EXPECT_THROW(f.get_string_or("n", "fallback"), GgufError);
}

TEST(GgufGetters, TensorDataChecksForeignInfo) {
  const GgufFile f = GgufFile::from_bytes(small_model().bytes());
  GgufTensorInfo fake = f.tensor("output.weight");
  fake.offset += 4096;
  EXPECT_THROW(f.tensor_data(fake), GgufError);
}

TEST(GgufGetters, MovedFileKeepsItsData) {
  GgufFile f = GgufFile::from_bytes(small_model().bytes());
  const GgufTensorInfo* t = f.find_tensor("norm.weight");
  GgufFile g = std::move(f);
  EXPECT_EQ(g.find_tensor("norm.weight"), t);
  EXPECT_EQ(g.tensor_data(*t).size(), 16u);
}

// ---- malformed files: every one is a GgufError naming what is wrong ----

TEST(GgufMalformed, TooSmallForMagic) {
  expect_rejected({}, {"too small", "0 bytes"});
  expect_rejected({'G', 'G', 'U'}, {"too small"});
}

TEST(GgufMalformed, BadMagic) {
  Raw r;
  r.header(0, 0);
  r.b[3] = 'X';
  expect_rejected(r.b, {"bad magic", "47 47 55 58"});
}

TEST(GgufMalformed, Version1IsUnsupported) { expect_rejected(Raw().header(0, 0, 1).b, {"version 1", "not supported"}); }

TEST(GgufMalformed, UnknownVersion) {
  expect_rejected(Raw().header(0, 0, 4).b, {"unsupported GGUF version 4"});
  expect_rejected(Raw().header(0, 0, 0).b, {"unsupported GGUF version 0"});
}

TEST(GgufMalformed, BigEndianFile) {
  expect_rejected(Raw().header(0, 0, 0x03000000).b, {"unsupported GGUF version 50331648", "big-endian"});
}

TEST(GgufMalformed, TruncatedCounts) {
  Raw r;
  r.header(0, 0);
  r.b.resize(12);
  expect_rejected(r.b, {"truncated", "tensor count", "offset 8"});
}

TEST(GgufMalformed, MetadataCountLargerThanTheFile) {
  expect_rejected(Raw().header(0, std::uint64_t{1} << 60).zeros(64).b,
                  {"metadata count 1152921504606846976", "64 bytes"});
}

TEST(GgufMalformed, TensorCountLargerThanTheFile) {
  expect_rejected(Raw().header(~std::uint64_t{0}, 0).b, {"tensor count 18446744073709551615"});
}

TEST(GgufMalformed, KeyLengthPastTheEnd) {
  expect_rejected(Raw().header(0, 1).u64(1000).zeros(13).b, {"metadata entry 0", "key of 1000 bytes", "past the end"});
}

TEST(GgufMalformed, EmptyKey) {
  expect_rejected(Raw().header(0, 1).str("").u32(4).u32(1).b, {"metadata entry 0", "empty key"});
}

TEST(GgufMalformed, DuplicateKey) {
  expect_rejected(Raw().header(0, 2).kv_u32("llama.block_count", 1).kv_u32("llama.block_count", 2).b,
                  {"metadata key 'llama.block_count'", "duplicate key"});
}

TEST(GgufMalformed, UnknownValueType) {
  expect_rejected(Raw().header(0, 1).str("k").u32(13).u32(0).b, {"metadata key 'k'", "unknown value type 13"});
}

TEST(GgufMalformed, InvalidBoolByte) {
  expect_rejected(Raw().header(0, 1).str("flag").u32(7).u8(2).b, {"metadata key 'flag'", "invalid BOOL byte 2"});
}

TEST(GgufMalformed, InvalidBoolInsideArray) {
  expect_rejected(Raw().header(0, 1).str("flags").u32(9).u32(7).u64(3).u8(0).u8(1).u8(255).b,
                  {"metadata key 'flags'[2]", "invalid BOOL byte 255"});
}

TEST(GgufMalformed, StringValuePastTheEnd) {
  expect_rejected(Raw().header(0, 1).str("general.name").u32(8).u64(50).zeros(10).b,
                  {"metadata key 'general.name'", "string of 50 bytes", "past the end"});
}

TEST(GgufMalformed, ArrayCountLargerThanTheFile) {
  // 2^60 strings would be rejected before anything is reserved for them.
  expect_rejected(
      Raw().header(0, 1).str("tokenizer.ggml.tokens").u32(9).u32(8).u64(std::uint64_t{1} << 60).zeros(100).b,
      {"metadata key 'tokenizer.ggml.tokens'", "array of 1152921504606846976 STRING items", "cannot fit"});
  expect_rejected(Raw().header(0, 1).str("a").u32(9).u32(12).u64(13).zeros(100).b, {"array of 13 FLOAT64 items"});
}

TEST(GgufMalformed, TooManyArrayItems) {
  constexpr std::uint64_t kItems = (std::uint64_t{1} << 24) + 1;
  Raw r;
  r.header(0, 1).str("bytes").u32(9).u32(0).u64(kItems).zeros(kItems);
  expect_rejected(r.b, {"metadata key 'bytes'", "exceeds the limit of 16777216"});
}

TEST(GgufMalformed, UnknownArrayElementType) {
  expect_rejected(Raw().header(0, 1).str("a").u32(9).u32(99).u64(0).b,
                  {"metadata key 'a'", "unknown array element type 99"});
}

TEST(GgufMalformed, ArraysNestedTooDeep) {
  auto nested = [](int depth) {
    Raw r;
    r.header(0, 1).str("deep").u32(9);
    for (int i = 1; i < depth; ++i) r.u32(9).u64(1);  // an array holding one array
    r.u32(4).u64(0);                                  // the innermost: no UINT32 items
    return r.b;
  };
  EXPECT_NO_THROW(GgufFile::from_bytes(nested(8)));
  expect_rejected(nested(9), {"metadata key 'deep'[0][0][0][0][0][0][0]", "nested more than 8 deep"});
}

TEST(GgufMalformed, AlignmentOfTheWrongType) {
  expect_rejected(Raw().header(0, 1).str("general.alignment").u32(10).u64(64).b,
                  {"'general.alignment' has type UINT64, expected UINT32"});
}

TEST(GgufMalformed, AlignmentNotAPowerOfTwo) {
  expect_rejected(Raw().header(0, 1).kv_u32("general.alignment", 48).b, {"'general.alignment'", "48", "power of two"});
  expect_rejected(Raw().header(0, 1).kv_u32("general.alignment", 0).b,
                  {"'general.alignment'", "0 is not", "power of two"});
}

TEST(GgufMalformed, EmptyTensorName) {
  expect_rejected(Raw().header(1, 0).tensor("", {32}, GgmlType::F32, 0).pad().zeros(128).b, {"tensor 0", "empty name"});
}

TEST(GgufMalformed, DuplicateTensorName) {
  expect_rejected(
      Raw().header(2, 0).tensor("w", {8}, GgmlType::F32, 0).tensor("w", {8}, GgmlType::F32, 32).pad().zeros(64).b,
      {"tensor 'w'", "duplicate tensor name"});
}

TEST(GgufMalformed, ZeroDims) {
  expect_rejected(Raw().header(1, 0).str("w").u32(0).u32(0).u64(0).pad().zeros(32).b, {"tensor 'w'", "n_dims 0"});
}

TEST(GgufMalformed, TooManyDims) {
  expect_rejected(Raw().header(1, 0).tensor("w", {1, 1, 1, 1, 1}, GgmlType::F32, 0).pad().zeros(32).b,
                  {"tensor 'w'", "n_dims 5"});
}

TEST(GgufMalformed, ZeroDimension) {
  expect_rejected(Raw().header(1, 0).tensor("w", {4, 0}, GgmlType::F32, 0).pad().zeros(32).b,
                  {"tensor 'w'", "ne[1] = 0 is not positive"});
}

TEST(GgufMalformed, NegativeDimension) {
  expect_rejected(Raw().header(1, 0).tensor("w", {~std::uint64_t{0}}, GgmlType::F32, 0).pad().zeros(32).b,
                  {"tensor 'w'", "ne[0] = -1 is not positive"});
}

TEST(GgufMalformed, ElementCountOverflow) {
  expect_rejected(Raw().header(1, 0).tensor("w", {1u << 31, 1u << 31, 1u << 31}, GgmlType::F32, 0).pad().zeros(32).b,
                  {"tensor 'w'", "element count overflows", "ne[2]"});
}

TEST(GgufMalformed, DataSizeOverflow) {
  // 2^62 elements fit int64, but 4 bytes each do not fit 64 bits.
  expect_rejected(Raw().header(1, 0).tensor("w", {1u << 31, 1u << 31}, GgmlType::F32, 0).pad().zeros(32).b,
                  {"tensor 'w'", "overflows 64 bits"});
}

TEST(GgufMalformed, UnknownTensorType) {
  expect_rejected(Raw().header(1, 0).str("w").u32(1).u64(32).u32(4).u64(0).pad().zeros(32).b,
                  {"tensor 'w'", "unknown tensor type id 4"});
}

TEST(GgufMalformed, RowNotAWholeNumberOfBlocks) {
  expect_rejected(Raw().header(1, 0).tensor("blk.0.ffn_up.weight", {33, 2}, GgmlType::Q4_0, 0).pad().zeros(128).b,
                  {"tensor 'blk.0.ffn_up.weight'", "ne[0] = 33", "Q4_0 block size 32"});
}

TEST(GgufMalformed, OffsetNotAligned) {
  expect_rejected(Raw().header(1, 0).tensor("w", {4}, GgmlType::F32, 16).pad().zeros(64).b,
                  {"tensor 'w'", "data offset 16", "alignment 32"});
  // The alignment the file sets is the one that counts.
  expect_rejected(
      Raw().header(1, 1).kv_u32("general.alignment", 64).tensor("w", {4}, GgmlType::F32, 32).pad(64).zeros(128).b,
      {"data offset 32", "alignment 64"});
}

TEST(GgufMalformed, TensorDataPastTheEnd) {
  Raw r;
  r.header(1, 0).tensor("blk.3.attn_q.weight", {64, 2}, GgmlType::Q8_0, 32).pad();
  const std::size_t data_start = r.b.size();
  r.zeros(32 + 136 - 1);
  expect_rejected(r.b, {"tensor 'blk.3.attn_q.weight': data [offset 32, 136 bytes] extends past the end of the file",
                        "data section at " + std::to_string(data_start), "file size " + std::to_string(r.b.size())});
  // Offsets near 2^64 must not wrap around.
  expect_rejected(Raw().header(1, 0).tensor("w", {8}, GgmlType::F32, ~std::uint64_t{31}).pad().zeros(64).b,
                  {"tensor 'w'", "extends past the end"});
}

TEST(GgufMalformed, DataSectionPastTheEnd) {
  Raw r;
  r.header(1, 0).tensor("w", {1}, GgmlType::F32, 0);
  const std::size_t header_end = r.b.size();
  expect_rejected(r.b, {"data section starts at offset " + std::to_string((header_end + 31) / 32 * 32),
                        "past the end of the file (size " + std::to_string(header_end) + ")"});
}

TEST(GgufMalformed, OverlappingTensors) {
  expect_rejected(
      Raw().header(2, 0).tensor("a", {16}, GgmlType::F32, 0).tensor("b", {8}, GgmlType::F32, 32).pad().zeros(96).b,
      {"tensors 'a' [offset 0, 64 bytes] and 'b' [offset 32] overlap"});
  expect_rejected(
      Raw().header(2, 0).tensor("a", {8}, GgmlType::F32, 0).tensor("b", {8}, GgmlType::F32, 0).pad().zeros(64).b,
      {"overlap"});
}

TEST(GgufMalformed, TruncatedTensorInfo) {
  expect_rejected(Raw().header(1, 0).str("blk.0.attn_k.weight").u32(2).u64(64).u32(0).b,
                  {"tensor 'blk.0.attn_k.weight'", "truncated: ne[1]"});
}

TEST(GgufMalformed, NamesFromTheFileAreEscapedAndShortened) {
  const std::string name = std::string("bad\n\x01'name") + std::string(200, 'x');
  const std::string msg =
      error_of(Raw().header(2, 0).tensor(name, {8}, GgmlType::F32, 0).tensor(name, {8}, GgmlType::F32, 32).b);
  EXPECT_NE(msg.find("tensor 'bad\\x0a\\x01\\x27name"), std::string::npos) << msg;
  EXPECT_NE(msg.find("...'"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 200u) << msg;
}

TEST(GgufMalformed, OpenNamesThePath) {
  const std::string path = temp_path("bad.gguf");
  std::vector<std::uint8_t> bytes = small_model().bytes();
  bytes[4] = 1;
  write_file(path, bytes);
  try {
    GgufFile::open(path);
    ADD_FAILURE() << "no GgufError";
  } catch (const GgufError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(path + ": header: GGUF version 1", 0), 0u) << e.what();
  }
  std::filesystem::remove(path);
  EXPECT_THROW(GgufFile::open(path), GgufError);                // missing
  EXPECT_THROW(GgufFile::open(testing::TempDir()), GgufError);  // a directory
  const std::string empty = temp_path("empty.gguf");
  write_file(empty, {});
  EXPECT_THROW(GgufFile::open(empty), GgufError);
  std::filesystem::remove(empty);
}

// ---- truncation and corruption ----

TEST(GgufTruncation, EveryPrefixOfAValidFileIsRejected) {
  const std::vector<std::uint8_t> bytes = small_model().bytes();
  ASSERT_NO_THROW(GgufFile::from_bytes(bytes));
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    const std::vector<std::uint8_t> prefix(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(GgufFile::from_bytes(prefix), GgufError) << "prefix of " << n << " bytes";
  }
}

TEST(GgufTruncation, EverySingleByteCorruptionParsesOrThrowsGgufError) {
  const std::vector<std::uint8_t> bytes = small_model().bytes();
  int rejected = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    for (std::uint8_t v : {std::uint8_t{0x00}, std::uint8_t{0xff}, static_cast<std::uint8_t>(bytes[i] ^ 0x80)}) {
      std::vector<std::uint8_t> corrupt = bytes;
      corrupt[i] = v;
      try {
        const GgufFile f = GgufFile::from_bytes(corrupt);
        for (const GgufTensorInfo& t : f.tensors()) EXPECT_LE(f.tensor_data(t).size(), corrupt.size());
      } catch (const GgufError&) {
        ++rejected;
      }
    }
  }
  EXPECT_GT(rejected, 0);
}

// ---- the real model ----

TEST(GgufRealModel, SmolLM2Header) {
  ASSERT_TRUE(std::filesystem::exists(kModel))
      << kModel << " is missing: run scripts/fetch-model.sh (CI fetches it before the tests)";
  const GgufFile f = GgufFile::open(kModel);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_u32("llama.block_count"), 30u);
  EXPECT_EQ(f.get_u32("llama.context_length"), 8192u);
  EXPECT_EQ(f.get_u32("llama.embedding_length"), 576u);
  EXPECT_EQ(f.get_u32("llama.attention.head_count"), 9u);
  EXPECT_EQ(f.get_u32("llama.attention.head_count_kv"), 3u);
  EXPECT_EQ(f.get_f64("llama.rope.freq_base"), 100000.0);
  EXPECT_FALSE(f.get_bool("tokenizer.ggml.add_bos_token"));
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f.metadata().size(), 33u);
  EXPECT_EQ(f.tensors().size(), 272u);
  const std::vector<std::string> tokens = f.get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 49152u);
  EXPECT_EQ(tokens[1], "<|im_start|>");
  EXPECT_EQ(f.get_int_array("tokenizer.ggml.token_type").size(), 49152u);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.merges").size(), 48900u);

  const GgufTensorInfo& emb = f.tensor("token_embd.weight");
  EXPECT_EQ(emb.type, GgmlType::Q8_0);
  EXPECT_EQ(emb.ne, (std::vector<std::int64_t>{576, 49152}));
  EXPECT_EQ(emb.bytes, 576u / 32 * 34 * 49152);
  EXPECT_EQ(f.tensor_data(emb).size(), emb.bytes);
  EXPECT_EQ(f.tensor("blk.0.ffn_down.weight").type, GgmlType::Q4_1);
  EXPECT_EQ(f.tensor("blk.29.attn_norm.weight").type, GgmlType::F32);

  // llama.cpp packs tensors back to back at aligned offsets: each one must start where the
  // previous ends, which checks every computed size against the writer's.
  std::vector<const GgufTensorInfo*> by_offset;
  for (const GgufTensorInfo& t : f.tensors()) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  EXPECT_EQ(by_offset[0]->offset, 0u);
  for (std::size_t i = 1; i < by_offset.size(); ++i)
    EXPECT_EQ(by_offset[i]->offset, (by_offset[i - 1]->offset + by_offset[i - 1]->bytes + 31) / 32 * 32)
        << by_offset[i]->name;
}

}  // namespace
}  // namespace witcert::model
