// Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 weights; head_dim 256, one KV head, GeGLU,
// q/k norms, post-norms, sliding-window layers) on the engine: its next token where llama.cpp and
// the numpy reference of tools/reference_llama.py agree, for a short prompt and for one of 1,372
// tokens that the sliding window of 512 masks in five layers of six, and every certified format
// sound on it past the window (every served cell of a teacher-forced run checked against the true
// TV from the exact tier), gated and not.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <span>
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
  EXPECT_EQ(cfg.context, 32768);
  EXPECT_EQ(cfg.sliding_window, 512);
  EXPECT_EQ(cfg.rope_layout, cert::RopeLayout::neox);
  const std::vector<std::int32_t> prompt = gemma().checked_prompt("The capital of France is", false);
  EXPECT_EQ(prompt, (std::vector<std::int32_t>{2, 818, 5279, 529, 7001, 563}));  // bos, then llama.cpp's ids
  attention::ExactKvCache cache(cfg.kv_geometry(16));
  ThreadPool pool(2);
  Session session(*gemma().model, cache, pool);
  const std::span<const float> logits = session.prefill(prompt);  // the session's buffer: it must outlive the span
  // " the": the top token of llama.cpp and of the float64 reference on this GGUF.
  EXPECT_EQ(std::max_element(logits.begin(), logits.end()) - logits.begin(), 506);
}

TEST_F(GemmaModel, APromptPastTheSlidingWindowContinuesAsTheReferencesDo) {
  const model::LlamaConfig& cfg = gemma().model->config();
  std::string text;
  const char* weather[] = {"calm", "windy", "foggy"};
  for (int i = 0; i < 60; ++i)
    text += "The keeper's log, page " + std::to_string(i) + ". The lamp was lit at dusk and the weather was " +
            weather[i % 3] + ". ";
  const std::vector<std::int32_t> prompt = gemma().checked_prompt(text, false);
  ASSERT_EQ(prompt.size(), 1372u);  // llama.cpp's tokenization of the same text, bos included
  attention::ExactKvCache cache(cfg.kv_geometry(static_cast<std::int64_t>(prompt.size())));
  ThreadPool pool(2);
  Session session(*gemma().model, cache, pool);
  const std::span<const float> logits = session.prefill(prompt);
  // The float64 reference's top two, which are llama.cpp's (logits 13.390 and 12.106 in the
  // reference; the engine is within 1.1e-3 of it on the top ten).
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + 2, order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  EXPECT_EQ(order[0], 236770);
  EXPECT_EQ(order[1], 236812);
  EXPECT_NEAR(logits[236770] - logits[236812], 13.3895 - 12.1059, 5e-3);
}

TEST_F(GemmaModel, EveryCertifiedFormatIsSoundAtHeadDim256) {
  const model::LlamaConfig& cfg = gemma().model->config();
  std::string text;
  while (text.size() < 2400) text += "The keeper's log recorded the weather, the oil burned and every ship that passed. ";
  const std::vector<std::int32_t> long_prompt = gemma().checked_prompt(text, false);
  ASSERT_GT(long_prompt.size(), 540u);  // past the sliding window of 512
  ASSERT_LT(long_prompt.size(), 700u);
  const std::vector<std::int32_t> short_prompt(long_prompt.begin(), long_prompt.begin() + 200);
  ThreadPool pool(2);
  // One format of each family the kernel decodes differently (llama.cpp blocks, Tier B, groups,
  // rotation), gated and not; two of them past the window (the check reads every key of every
  // cell twice, so the long prompt costs about ten times the short one).
  struct Case {
    const char* fmt;
    double tau;
    bool past_window;
  };
  for (const Case& c : {Case{"q4_0", 0.0, false}, Case{"q4_0", 0.2, true}, Case{"dither-int8", 0.0, true},
                        Case{"dither-int8", 0.2, false}, Case{"kivi-2bit", 0.0, false}, Case{"kivi-2bit", 0.2, false},
                        Case{"rot-4bit", 0.0, false}, Case{"rot-4bit", 0.2, false}}) {
    const std::vector<std::int32_t>& tokens = c.past_window ? long_prompt : short_prompt;
    SCOPED_TRACE(std::string(c.fmt) + " tau " + std::to_string(c.tau) + " tokens " + std::to_string(tokens.size()));
    CacheOptions opts;
    opts.certified = true;
    opts.k_format = formats::KvFormat::parse(c.fmt);
    opts.v_format = formats::KvFormat::parse(c.fmt);
    opts.check_soundness = true;
    opts.gate.set_tau_k(c.tau);
    gate::CellLog log;
    const Cache cache = make_cache(cfg, static_cast<std::int64_t>(tokens.size()), 1, opts, {&log});
    Session(*gemma().model, *cache.kv, pool, 64).prefill(tokens);
    long checked = 0, violations = 0;
    for (const gate::MeterCell& cell : log.cells()) {
      if (std::isnan(cell.tv)) continue;
      ++checked;
      violations += gate::violates(cell);
    }
    EXPECT_EQ(checked, static_cast<long>(tokens.size()) * cfg.layers * cfg.heads);
    EXPECT_EQ(violations, 0);
  }
}

}  // namespace
}  // namespace witcert::engine
