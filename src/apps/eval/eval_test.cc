#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "apps/eval/eval.h"

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

TEST(Eval, DurationsReadAsAPersonWritesThem) {
  EXPECT_EQ(format_duration(12.4), "12s");
  EXPECT_EQ(format_duration(187), "3m07s");
  EXPECT_EQ(format_duration(3720), "1h02m");
  EXPECT_EQ(format_duration(NAN), "?");
  EXPECT_EQ(format_duration(HUGE_VAL), "?");
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
