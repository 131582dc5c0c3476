#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "apps/eval/eval.h"
#include "apps/eval/internal.h"

namespace witcert::apps::eval {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(Eval, AurocKnownAnswers) {
  // Perfect, reversed, chance-level and tied classifiers.
  EXPECT_DOUBLE_EQ(auroc({0.1, 0.2, 0.8, 0.9}, {false, false, true, true}), 1.0);
  EXPECT_DOUBLE_EQ(auroc({0.9, 0.8, 0.2, 0.1}, {false, false, true, true}), 0.0);
  EXPECT_DOUBLE_EQ(auroc({0.5, 0.5, 0.5, 0.5}, {false, true, false, true}), 0.5);
  // One inversion among 2 × 2 pairs: 3/4.
  EXPECT_DOUBLE_EQ(auroc({0.1, 0.6, 0.5, 0.9}, {false, false, true, true}), 0.75);
  // A tie between a positive and a negative counts one half: (1 + 1 + 0.5 + 1) / 4.
  EXPECT_DOUBLE_EQ(auroc({0.1, 0.5, 0.5, 0.9}, {false, false, true, true}), 0.875);
  EXPECT_TRUE(std::isnan(auroc({0.1, 0.2}, {true, true})));
  EXPECT_TRUE(std::isnan(auroc({}, {})));
  // +inf scores (no guarantee) rank above every finite one.
  EXPECT_DOUBLE_EQ(auroc({HUGE_VAL, 0.1, 0.2}, {true, false, false}), 1.0);
  EXPECT_THROW(auroc({0.1}, {true, false}), std::invalid_argument);
}

TEST(Eval, RocCurveRunsFromCornerToCorner) {
  const auto pts = roc_curve({0.9, 0.8, 0.7, 0.1}, {true, false, true, false});
  ASSERT_GE(pts.size(), 2u);
  EXPECT_EQ(pts.front(), std::make_pair(0.0, 0.0));
  EXPECT_EQ(pts.back(), std::make_pair(1.0, 1.0));
  EXPECT_EQ(pts[1], std::make_pair(0.0, 0.5));  // the top score is a positive
  EXPECT_EQ(pts[2], std::make_pair(0.5, 0.5));
  for (std::size_t i = 1; i < pts.size(); ++i) EXPECT_TRUE(pts[i].first >= pts[i - 1].first && pts[i].second >= pts[i - 1].second);
}

TEST(Eval, RuleOfThree) {
  EXPECT_DOUBLE_EQ(rule_of_three(0), 1.0);
  EXPECT_NEAR(rule_of_three(1), 0.95, 1e-12);
  EXPECT_NEAR(rule_of_three(1000), 3.0 / 1000, 2e-5);  // ≈ 3/n for large n
  EXPECT_NEAR(std::pow(1 - rule_of_three(300), 300), 0.05, 1e-12);
}

TEST(Eval, PercentileIsTheNearestRank) {
  EXPECT_EQ(percentile({4, 1, 3, 2}, 0.5), 2.0);
  EXPECT_EQ(percentile({4, 1, 3, 2}, 0.0), 1.0);
  EXPECT_EQ(percentile({4, 1, 3, 2}, 1.0), 4.0);
  EXPECT_EQ(percentile({4, 1, 3, 2}, 0.95), 4.0);
  EXPECT_EQ(percentile({7}, 0.3), 7.0);
  EXPECT_TRUE(std::isnan(percentile({}, 0.5)));
}

TEST(Eval, McNemarExactKnownAnswers) {
  EXPECT_EQ(mcnemar_p(0, 0), 1.0);
  EXPECT_DOUBLE_EQ(mcnemar_p(0, 6), 2.0 / 64);         // 2·P(X ≤ 0), X ~ Bin(6, ½)
  EXPECT_DOUBLE_EQ(mcnemar_p(9, 1), 2.0 * 11 / 1024);  // 2·P(X ≤ 1), X ~ Bin(10, ½)
  EXPECT_DOUBLE_EQ(mcnemar_p(1, 9), mcnemar_p(9, 1));  // two-sided
  EXPECT_EQ(mcnemar_p(5, 5), 1.0);                     // capped at 1
  EXPECT_LT(mcnemar_p(0, 30), 1e-8);
  // Past the exact range: the log-domain sum, continuous with it.
  EXPECT_NEAR(mcnemar_p(480, 521), 0.2062, 0.002);  // normal approximation: z = 40/sqrt(1001) ≈ 1.264
}

TEST(Eval, PairedBootstrapCoversTheMeanDifference) {
  // Identical and uniformly shifted pairs: a degenerate interval at the difference.
  const std::vector<double> zeros(50, 0.0), ones(50, 1.0);
  EXPECT_EQ(paired_bootstrap_ci(zeros, zeros, 1000, 1), std::make_pair(0.0, 0.0));
  EXPECT_EQ(paired_bootstrap_ci(zeros, ones, 1000, 1), std::make_pair(1.0, 1.0));
  // 30 of 100 prompts gained, none lost: mean 0.3, standard error about 0.046.
  std::vector<double> a(100, 0.0), b(100, 0.0);
  for (int i = 0; i < 30; ++i) b[i] = 1.0;
  const auto [lo, hi] = paired_bootstrap_ci(a, b, 10000, 3);
  EXPECT_GT(lo, 0.19);
  EXPECT_LT(lo, 0.24);
  EXPECT_GT(hi, 0.36);
  EXPECT_LT(hi, 0.41);
  // The pairing matters: b is a shuffled a, so unpaired means agree, yet pairs differ.
  std::vector<double> c = {1, 0, 1, 0, 1, 0, 1, 0}, d = {0, 1, 0, 1, 0, 1, 0, 1};
  const auto [l2, h2] = paired_bootstrap_ci(c, d, 10000, 4);
  EXPECT_LT(l2, 0.0);
  EXPECT_GT(h2, 0.0);
  EXPECT_TRUE(std::isnan(paired_bootstrap_ci({}, {}, 10, 1).first));
  EXPECT_TRUE(std::isnan(paired_bootstrap_ci({1.0}, {1.0, 2.0}, 10, 1).first));
}

// The needle prompts: reproducible from their seed, every one holding its own passphrase once in
// the needle sentence at its depth, near its length, with the question after the haystack.
TEST(Eval, NeedlePromptsHoldTheirAnswerAtTheirDepth) {
  const engine::Model m = engine::Model::load(std::string(WITCERT_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf");
  const std::vector<NeedlePrompt> a = needle_prompts(m, 40, 96, 256, 61), b = needle_prompts(m, 40, 96, 256, 61);
  std::set<std::string> answers;
  for (std::size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(a[i].text, b[i].text);
    const std::string& t = a[i].text;
    const std::size_t at = t.find(a[i].answer);
    ASSERT_NE(at, std::string::npos);
    EXPECT_EQ(t.find(a[i].answer, at + 1), std::string::npos);
    EXPECT_TRUE(answered("The passphrase is " + a[i].answer + ".", a[i].answer));
    EXPECT_FALSE(answered("I do not know.", a[i].answer));
    EXPECT_GE(a[i].depth, 0.1);
    EXPECT_LE(a[i].depth, 0.9);
    EXPECT_GE(a[i].target_tokens, 96);
    EXPECT_LE(a[i].target_tokens, 256);
    const int tokens = static_cast<int>(m.tokenizer->encode(t, false).size());
    EXPECT_GE(tokens, a[i].target_tokens);
    EXPECT_LE(tokens, a[i].target_tokens + 80);  // the last filler sentence, the needle and the question
    // The needle sits at its depth of the text, within a sentence or two.
    const double where = static_cast<double>(at) / static_cast<double>(t.size());
    EXPECT_NEAR(where, a[i].depth, 0.25);
    EXPECT_LT(at, t.find("Question:"));
    answers.insert(a[i].answer);
  }
  EXPECT_GE(answers.size(), 38u);
  EXPECT_NE(needle_prompts(m, 1, 96, 256, 62)[0].text, a[0].text);
  EXPECT_THROW(needle_prompts(m, 1, 300, 200, 1), std::invalid_argument);
}

TEST(Eval, DurationsReadAsAPersonWritesThem) {
  EXPECT_EQ(format_duration(12.4), "12s");
  EXPECT_EQ(format_duration(187), "3m07s");
  EXPECT_EQ(format_duration(3720), "1h02m");
  EXPECT_EQ(format_duration(NAN), "?");
  EXPECT_EQ(format_duration(HUGE_VAL), "?");
}

TEST(Eval, ProgressInALogIsWholeLinesAtEachTenth) {
  // Into a file: no carriage return, the first line, then a line each time a tenth of the cells is
  // crossed (3, 5, 8, 10, 13, 15, 18, 20, 23 and 25 of 25), the last one complete.
  std::ostringstream log;
  {
    EtaBar bar(log, "cells", 25, /*terminal=*/false);
    bar.skip();
    for (int i = 1; i < 25; ++i) bar.advance();
    bar.finish();
  }
  const std::string text = log.str();
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 11);
  EXPECT_NE(text.find("0/25"), std::string::npos);
  EXPECT_NE(text.find("25/25"), std::string::npos);
  EXPECT_EQ(text.back(), '\n');

  // On a terminal: one line redrawn for every cell, ended by finish().
  std::ostringstream tty;
  {
    EtaBar bar(tty, "cells", 4, /*terminal=*/true);
    for (int i = 0; i < 4; ++i) bar.advance();
    bar.finish();
  }
  const std::string drawn = tty.str();
  EXPECT_EQ(std::count(drawn.begin(), drawn.end(), '\r'), 5);
  EXPECT_EQ(std::count(drawn.begin(), drawn.end(), '\n'), 1);
}

TEST(Eval, TheStoreResumesAndDropsATornLine) {
  const fs::path dir = fs::path(testing::TempDir()) / "eval_store";
  fs::remove_all(dir);
  const std::string path = (dir / "results.jsonl").string();
  {
    ResultStore s(path);
    EXPECT_EQ(s.size(), 0u);
    s.put("a", {{"x", 1}});
    s.put("b", {{"x", 2}});
  }
  std::ofstream(path, std::ios::app) << "{\"key\": \"c\", \"x\":";  // a run killed mid-line
  ResultStore s(path);
  EXPECT_EQ(s.size(), 2u);
  EXPECT_TRUE(s.has("a") && s.has("b") && !s.has("c"));
  EXPECT_EQ(s.get("b").at("x"), 2);
  // After the torn line, a new record starts on a line of its own and is read back.
  std::ofstream(path, std::ios::app) << "\n";
  s.put("c", {{"x", 3}});
  EXPECT_EQ(ResultStore(path).get("c").at("x"), 3);
}

TEST(Eval, TablesQuoteCsvAndFormatMarkdown) {
  const fs::path dir = fs::path(testing::TempDir()) / "eval_table";
  fs::remove_all(dir);
  write_table(dir.string(), "t", {"name", "value", "missing"},
              {json{{"name", "a, \"b\""}, {"value", 0.123456}}, json{{"name", "c"}, {"value", HUGE_VAL}}}, "A table");
  EXPECT_EQ(read(dir / "t.csv"), "name,value,missing\n\"a, \"\"b\"\"\",0.123456,\nc,inf,\n");
  const std::string md = read(dir / "t.md");
  EXPECT_NE(md.find("**A table**"), std::string::npos);
  EXPECT_NE(md.find("| name | value | missing |"), std::string::npos);
  EXPECT_NE(md.find("| a, \"b\" | 0.1235 | – |"), std::string::npos) << md;
}

}  // namespace
}  // namespace witcert::apps::eval
