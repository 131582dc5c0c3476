#include "model/gguf.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

namespace witcert::model {
namespace {

using quant::GgmlType;

const std::string kModel = std::string(WITCERT_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

TEST(GgufRealModel, SmolLM2Header) {
  ASSERT_TRUE(std::filesystem::exists(kModel))
      << kModel << " is missing: run scripts/fetch-model.sh (CI fetches it before the tests)";
  const GgufFile f = GgufFile::open(kModel);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_u32("llama.block_count"), 30u);
  EXPECT_EQ(f.tensors().size(), 272u);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  const GgufTensorInfo& emb = f.tensor("token_embd.weight");
  EXPECT_EQ(emb.type, GgmlType::Q8_0);
  EXPECT_EQ(emb.ne, (std::vector<std::int64_t>{576, 49152}));
  EXPECT_EQ(emb.bytes, 576u / 32 * 34 * 49152);
  EXPECT_EQ(f.tensor_data(emb).size(), emb.bytes);
}

}  // namespace
}  // namespace witcert::model
