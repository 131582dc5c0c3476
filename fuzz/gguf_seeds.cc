// Writes a few small valid GGUF files, the fuzzer's seed corpus, into the directory given as the
// only argument (generated rather than committed, so they follow the writer).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "model/gguf.h"

using witcert::model::GgufArray;
using witcert::model::GgufType;
using witcert::model::GgufValue;
using witcert::model::GgufWriter;
using witcert::formats::GgmlType;

namespace {

GgufValue array(GgufType element, std::vector<GgufValue> items) {
  auto a = std::make_shared<GgufArray>();
  a->element_type = element;
  a->items = std::move(items);
  return {GgufType::ARRAY, std::move(a)};
}

GgufWriter tiny_llama() {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", 1);
  w.add_u32("llama.embedding_length", 32);
  w.add_f32("llama.rope.freq_base", 10000.0f);
  w.add_bool("tokenizer.ggml.add_bos_token", true);
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string_array("tokenizer.ggml.tokens", {"<s>", "</s>", "a", "b"});
  w.add_i32_array("tokenizer.ggml.token_type", {3, 3, 1, 1});
  w.add_f32_array("tokenizer.ggml.scores", {0.0f, 0.0f, -1.0f, -2.0f});
  w.add_f32_tensor("output_norm.weight", {32}, std::vector<float>(32, 1.0f));
  w.add_tensor("token_embd.weight", {32, 4}, GgmlType::Q8_0, std::vector<std::uint8_t>(34 * 4, 1));
  w.add_tensor("blk.0.attn_q.weight", {32, 32}, GgmlType::Q4_1, std::vector<std::uint8_t>(20 * 32, 2));
  return w;
}

GgufWriter every_value_type() {
  GgufWriter w;
  w.add("u8", {GgufType::UINT8, std::uint64_t{200}});
  w.add("i8", {GgufType::INT8, std::int64_t{-100}});
  w.add("u16", {GgufType::UINT16, std::uint64_t{60000}});
  w.add("i16", {GgufType::INT16, std::int64_t{-30000}});
  w.add("u32", {GgufType::UINT32, std::uint64_t{4000000000u}});
  w.add("i32", {GgufType::INT32, std::int64_t{-2000000000}});
  w.add("u64", {GgufType::UINT64, std::uint64_t{1} << 63});
  w.add("i64", {GgufType::INT64, std::int64_t{-1}});
  w.add("f32", {GgufType::FLOAT32, 0.5});
  w.add("f64", {GgufType::FLOAT64, -0.25});
  w.add("b", {GgufType::BOOL, true});
  w.add("s", {GgufType::STRING, std::string("text")});
  w.add("nested",
        array(GgufType::ARRAY, {array(GgufType::BOOL, {{GgufType::BOOL, false}}), array(GgufType::BOOL, {})}));
  return w;
}

GgufWriter aligned_k_quants() {
  GgufWriter w;
  w.set_alignment(64);
  w.add_string("general.name", "k");
  w.add_tensor("q4_k", {256}, GgmlType::Q4_K, std::vector<std::uint8_t>(144, 3));
  w.add_tensor("q6_k", {256, 1, 1, 1}, GgmlType::Q6_K, std::vector<std::uint8_t>(210, 4));
  w.add_tensor("f16", {2, 2}, GgmlType::F16, std::vector<std::uint8_t>(8, 5));
  return w;
}

bool save(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::vector<std::uint8_t> v2 = tiny_llama().bytes();
  v2[4] = 2;
  const std::vector<std::pair<std::string, std::vector<std::uint8_t>>> seeds = {
      {"tiny_llama.gguf", tiny_llama().bytes()},
      {"tiny_llama_v2.gguf", v2},
      {"every_value_type.gguf", every_value_type().bytes()},
      {"aligned_k_quants.gguf", aligned_k_quants().bytes()},
      {"empty.gguf", GgufWriter().bytes()},
  };
  for (const auto& [name, bytes] : seeds) {
    if (!save(dir + "/" + name, bytes)) {
      std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
      return 1;
    }
  }
  return 0;
}
