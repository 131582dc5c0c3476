// Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 weights; head_dim 256, one KV head, GeGLU,
// q/k norms, post-norms, sliding-window layers) on the engine: its next token where llama.cpp and
// the numpy reference of tools/reference_llama.py agree, its context capped at the window with a
// message that says why, and every certified format sound on it (every served cell of a
// teacher-forced run checked against the true TV from the exact tier), gated and not.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/batch.h"
#include "engine/cache_factory.h"
#include "engine/model.h"
#include "engine/session.h"
#include "gate/certified_cache.h"

namespace witcert::engine {
namespace {

const std::string kGemma = std::string(WITCERT_SOURCE_DIR) + "/models/gemma-3-270m-q4_k_m.gguf";

class GemmaModel : public ::testing::Test {
 protected:
  static Model& gemma() {
    static Model m = Model::load(kGemma);
    return m;
  }
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(kGemma)) << kGemma << " is missing: run scripts/fetch-model.sh";
  }
};

TEST_F(GemmaModel, LoadsWithItsGeometryAndContinuesAsTheReferencesDo) {
  const model::LlamaConfig& cfg = gemma().model->config();
  EXPECT_EQ(cfg.arch, "gemma3");
  EXPECT_EQ(cfg.head_dim, 256);
  EXPECT_EQ(cfg.kv_heads, 1);
  EXPECT_EQ(cfg.heads, 4);
  EXPECT_EQ(cfg.context, 512);
  EXPECT_EQ(cfg.trained_context, 32768);
  EXPECT_EQ(cfg.rope_layout, cert::RopeLayout::neox);
  const std::vector<std::int32_t> prompt = gemma().checked_prompt("The capital of France is", false);
  EXPECT_EQ(prompt, (std::vector<std::int32_t>{2, 818, 5279, 529, 7001, 563}));  // bos, then llama.cpp's ids
  attention::ExactKvCache cache(cfg.kv_geometry(16));
  ThreadPool pool(2);
  Session session(*gemma().model, cache, pool);
  const std::span<const float> logits = session.prefill(prompt);  // the session's buffer: it must outlive the span
  // " the": the top token of llama.cpp and of the float64 reference on this GGUF.
  EXPECT_EQ(std::max_element(logits.begin(), logits.end()) - logits.begin(), 506);
  try {
    std::string long_text;
    for (int i = 0; i < 300; ++i) long_text += "The keeper's log, page " + std::to_string(i) + ". ";
    gemma().checked_prompt(long_text, false);
    ADD_FAILURE() << "a prompt beyond the window was accepted";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("sliding window of 512"), std::string::npos) << e.what();
  }
}

TEST_F(GemmaModel, EveryCertifiedFormatIsSoundAtHeadDim256) {
  const model::LlamaConfig& cfg = gemma().model->config();
  std::string text;
  while (text.size() < 1200) text += "The keeper's log recorded the weather, the oil burned and every ship that passed. ";
  const std::vector<std::int32_t> tokens = gemma().checked_prompt(text, false);
  ASSERT_GT(tokens.size(), 200u);
  ASSERT_LT(tokens.size(), 480u);
  ThreadPool pool(2);
  // One format of each family the kernel decodes differently (llama.cpp blocks, Tier B, groups, rotation).
  for (const char* fmt : {"q4_0", "dither-int8", "kivi-2bit", "rot-4bit"}) {
    for (const double tau : {0.0, 0.2}) {
      SCOPED_TRACE(std::string(fmt) + " tau " + std::to_string(tau));
      CacheOptions opts;
      opts.certified = true;
      opts.k_format = formats::KvFormat::parse(fmt);
      opts.v_format = formats::KvFormat::parse(fmt);
      opts.check_soundness = true;
      opts.gate.set_tau_k(tau);
      gate::CellLog log;
      const Cache cache = make_cache(cfg, static_cast<std::int64_t>(tokens.size()), 1, opts, {&log});
      Session(*gemma().model, *cache.kv, pool, 64).prefill(tokens);
      long checked = 0, violations = 0;
      for (const gate::MeterCell& c : log.cells()) {
        if (std::isnan(c.tv)) continue;
        ++checked;
        violations += !(c.tv <= c.meter * (1 + 1e-9) + 1e-12);
      }
      EXPECT_EQ(checked, static_cast<long>(tokens.size()) * cfg.layers * cfg.heads);
      EXPECT_EQ(violations, 0);
    }
  }
}

}  // namespace
}  // namespace witcert::engine
