// The request loop on the real SmolLM2-135M (needs the fetched model; CI fetches it).
#include "engine/session.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "model/real_model_fixture.h"

namespace witcert::engine {
namespace {

using RealModel = model::RealModelFixture;

TEST_F(RealModel, GreedyContinuationIsStableAcrossThreadCounts) {
  const std::vector<std::int32_t> prompt = tok_->encode("The capital of France is", false);
  std::vector<std::vector<std::int32_t>> runs;
  for (int threads : {1, 2, 2}) {
    ThreadPool pool(threads);
    attention::ExactKvCache cache(model_->config().kv_geometry(64));
    Session session(*model_, cache, pool);
    GenerateOptions opts;
    opts.max_new_tokens = 12;
    runs.push_back(generate(session, prompt, opts).tokens);
  }
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_EQ(runs[1], runs[2]);
  const std::string text = tok_->decode(runs[0]);
  std::printf("[real-model] greedy: \"The capital of France is%s\"\n", text.c_str());
  EXPECT_NE(text.find("Paris"), std::string::npos) << text;
}

TEST_F(RealModel, PerplexityOfAnEnglishParagraphIsSane) {
  const std::string paragraph =
      "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
      "combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
      "wine. Books, which had been copied by hand for centuries, could now be produced quickly and "
      "cheaply, and within a few decades printing shops had spread to most of the major cities of "
      "Europe. The new technology changed how knowledge was shared: scholars could compare identical "
      "copies of the same text, and ideas travelled faster than ever before.";
  const std::vector<std::int32_t> tokens = tok_->encode(paragraph, false);
  ThreadPool pool(2);
  attention::ExactKvCache cache(model_->config().kv_geometry(static_cast<std::int64_t>(tokens.size())));
  Session session(*model_, cache, pool);
  const double ppl = std::exp(teacher_forced_nll(session, tokens));
  std::printf("[real-model] perplexity %.3f over %zu tokens\n", ppl, tokens.size());
  EXPECT_GT(ppl, 2.0);
  EXPECT_LT(ppl, 40.0);
}

// Every way of reaching a position gives the same logits bit for bit: a prefill that keeps every
// row or only the last, chunks of any size, one token at a time, and a resumed copy of the cache.
TEST_F(RealModel, PrefillChunksRowsStepsAndResumeAgreeBitForBit) {
  const std::vector<std::int32_t> prompt = tok_->encode("One two three four five six seven eight nine ten", false);
  const std::int64_t n = static_cast<std::int64_t>(prompt.size());
  ThreadPool pool(2);
  const auto last_of = [&](int chunk, bool rows) {
    attention::ExactKvCache cache(model_->config().kv_geometry(n + 1));
    Session s(*model_, cache, pool, chunk);
    std::vector<std::vector<float>> kept;
    const std::span<const float> l =
        s.prefill(prompt, {}, rows ? LogitsSink([&](std::int64_t, std::span<const float> r) {
          kept.emplace_back(r.begin(), r.end());
        })
                                   : LogitsSink());
    if (rows) {
      EXPECT_EQ(static_cast<std::int64_t>(kept.size()), n);
      EXPECT_EQ(std::memcmp(kept.back().data(), l.data(), l.size_bytes()), 0);
    }
    EXPECT_EQ(s.position(), n);
    return std::vector<float>(l.begin(), l.end());
  };
  const std::vector<float> want = last_of(64, false);
  for (int chunk : {1, 3, 64})
    for (bool rows : {false, true}) {
      const std::vector<float> got = last_of(chunk, rows);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << chunk << " " << rows;
    }
  // Stepping the last token after a prefill of the rest, and after resuming a copy.
  attention::ExactKvCache cache(model_->config().kv_geometry(n + 1));
  Session head(*model_, cache, pool);
  const std::span<const float> before = head.prefill(std::span(prompt).first(n - 1));
  const std::vector<float> before_copy(before.begin(), before.end());
  attention::ExactKvCache copy = cache;
  const std::span<const float> stepped = head.step(prompt.back());
  EXPECT_EQ(std::memcmp(stepped.data(), want.data(), want.size() * sizeof(float)), 0);
  Session resumed(*model_, copy, pool);
  resumed.resume(n - 1, before_copy);
  const std::span<const float> again = resumed.step(prompt.back());
  EXPECT_EQ(std::memcmp(again.data(), want.data(), want.size() * sizeof(float)), 0);
}

TEST_F(RealModel, SessionRejectsWhatCannotRun) {
  ThreadPool pool(1);
  const std::vector<std::int32_t> nine(9, 1), none;
  attention::ExactKvCache cache(model_->config().kv_geometry(8));
  {
    Session s(*model_, cache, pool);
    EXPECT_THROW(s.prefill(none), std::invalid_argument);
    EXPECT_THROW(s.prefill(nine), std::out_of_range);  // beyond the cache
  }
  {
    attention::ExactKvCache c(model_->config().kv_geometry(8));
    Session s(*model_, c, pool);
    s.prefill(std::span(nine).first(8));
    EXPECT_THROW(s.prefill(std::span(nine).first(1)), std::logic_error);
    EXPECT_THROW(s.step(1), std::out_of_range);  // the ninth position
  }
  {
    attention::ExactKvCache c(model_->config().kv_geometry(8));
    Session s(*model_, c, pool);
    GenerateOptions opts;
    opts.sampler.top_p = 0.0f;
    EXPECT_THROW(generate(s, std::span(nine).first(1), opts), std::invalid_argument);
    EXPECT_THROW(decode(s, GenerateOptions{}), std::logic_error);  // nothing prefilled
  }
  EXPECT_THROW(Session(*model_, cache, pool, 0), std::invalid_argument);
  {
    attention::ExactKvCache c(model_->config().kv_geometry(8));
    Session s(*model_, c, pool);
    std::vector<float> short_logits(3);
    EXPECT_THROW(s.resume(4, short_logits), std::invalid_argument);
    std::vector<float> logits(model_->config().vocab);
    EXPECT_THROW(s.resume(9, logits), std::out_of_range);
  }
}

TEST_F(RealModel, GenerationStopsAtTheBudgetAndAtTheCache) {
  const std::vector<std::int32_t> prompt = tok_->encode("Count: one, two, three,", false);
  const std::int64_t n = static_cast<std::int64_t>(prompt.size());
  ThreadPool pool(2);
  for (int budget : {0, 1, 5}) {
    attention::ExactKvCache cache(model_->config().kv_geometry(n + 16));
    Session s(*model_, cache, pool);
    GenerateOptions opts;
    opts.max_new_tokens = budget;
    int choices = 0;
    const GenerateResult r = generate(s, prompt, opts, {}, [&](std::span<const float>) { ++choices; });
    EXPECT_EQ(static_cast<int>(r.tokens.size()), budget);
    EXPECT_EQ(choices, budget);
    EXPECT_EQ(s.position(), n + std::max(0, budget - 1));  // no forward pass after the last token
  }
  // A cache of n + 2 positions holds two generated tokens' keys: the third is the last chosen.
  attention::ExactKvCache cache(model_->config().kv_geometry(n + 2));
  Session s(*model_, cache, pool);
  GenerateOptions opts;
  opts.max_new_tokens = 10;
  EXPECT_EQ(generate(s, prompt, opts).tokens.size(), 3u);
}

}  // namespace
}  // namespace witcert::engine
