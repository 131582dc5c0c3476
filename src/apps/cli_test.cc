// The command-line contracts that external checkers rely on, exercised through the binary.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Result {
  int exit_code;
  std::string out;
};

Result run(const std::string& args, const std::string& stdin_text = "") {
  const std::string input = ::testing::TempDir() + "witcert_cli_input.txt";
  std::ofstream(input) << stdin_text;
  const std::string cmd = std::string(WITCERT_BIN) + " " + args + " < " + input + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::vector<nlohmann::json> lines(const std::string& out) {
  std::vector<nlohmann::json> v;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) v.push_back(nlohmann::json::parse(line));
  return v;
}

TEST(Cli, PhiloxPrintsKnownAnswers) {
  Result r = run("philox --counter 0,0,0,0 --key 0,0");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, "6627e8d5 e169c58d bc57ac4c 9b00dbd8\n");
  r = run("philox --counter 0x243f6a88,0x85a308d3,0x13198a2e,0x03707344 --key 0xa4093822,0x299f31d0");
  EXPECT_EQ(r.out, "d16cfe09 94fdcceb 5001e420 24126ea1\n");
  r = run("philox --counter 4294967295,0xffffffff,0xFFFFFFFF,4294967295 --key 0xffffffff,4294967295");
  EXPECT_EQ(r.out, "408f276d 41c83b0e a20bc7c6 6d5451fd\n");
}

TEST(Cli, PhiloxRejectsBadWords) {
  for (const char* args : {"philox --counter 0,0,0 --key 0,0", "philox --counter 0,0,0,0 --key 0x100000000,0",
                           "philox --counter 0,0,0,x --key 0,0", "philox --counter 0,0,0,0,0 --key 0,0",
                           "philox --counter 0,0,0,-1 --key 0,0", "philox --counter 0,0,0,0"}) {
    const Result r = run(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_FALSE(r.out.empty()) << "a clear message is expected for: " << args;
  }
}

TEST(Cli, BoundCounterexample) {
  const Result r = run("bound", R"({"p_tilde": [0.5, 0.5], "c": [0.1, 0.1], "eps": [0.1, -0.1]})" "\n");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto v = lines(r.out);
  ASSERT_EQ(v.size(), 1u);
  const auto& o = v[0];
  for (const char* key : {"eform", "two_sided", "retention", "tanh", "tanh_half", "raw", "meter", "tv"})
    ASSERT_TRUE(o.contains(key)) << key;
  EXPECT_NEAR(o["tv"].get<double>(), 0.049834, 5e-7);
  EXPECT_GE(o["meter"].get<double>(), o["tv"].get<double>());
  EXPECT_LE(o["meter"].get<double>(), 1.0);
  EXPECT_EQ(o["raw"], o["eform"]);
}

TEST(Cli, BoundWritesInfinityAsStringAndClampsTheMeter) {
  const Result r = run("bound", R"({"p_tilde": [0.5, 0.5], "c": [1000, 0]})" "\n");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto o = lines(r.out).at(0);
  EXPECT_EQ(o["raw"], "inf");
  EXPECT_EQ(o["eform"], "inf");
  EXPECT_EQ(o["meter"].get<double>(), 1.0);
  EXPECT_FALSE(o.contains("tv"));
}

TEST(Cli, BoundReportsBadLinesAndContinues) {
  const std::string input =
      "not json\n"
      R"({"p_tilde": [0.5, 0.5], "c": [0.1]})" "\n"
      R"({"p_tilde": [0.5, 0.5], "c": [0.1, -0.1]})" "\n"
      R"({"p_tilde": [0.5, 0.6], "c": [0.1, 0.1]})" "\n"
      R"({"p_tilde": [0.5, 0.5], "c": [0.1, 0.1], "eps": [0.2, 0.0]})" "\n"
      R"({"p_tilde": [0.25, 0.75], "c": [0.1, 0.1]})" "\n"
      R"({"p_tilde": [-0.5, 1.5], "c": [0.1, 0.1]})" "\n"
      R"({"p_tilde": [], "c": []})" "\n"
      R"({"c": [0.1]})" "\n"
      R"({"p_tilde": [0.5, 0.5000000000001], "c": [0.1, 0.1]})" "\n";
  const Result r = run("bound", input);
  EXPECT_NE(r.exit_code, 0);
  const auto v = lines(r.out);
  ASSERT_EQ(v.size(), 10u);
  for (int i : {0, 1, 2, 3, 4, 6, 7, 8}) {
    EXPECT_EQ(v[i]["line"], i + 1) << r.out;
    EXPECT_TRUE(v[i]["error"].is_string() && !v[i]["error"].get<std::string>().empty());
  }
  EXPECT_TRUE(v[5].contains("meter")) << "a good line after bad ones is still processed";
  EXPECT_TRUE(v[9].contains("meter")) << "a sum within 1e-9 of 1 is a distribution";
}

TEST(Cli, SelfcheckPasses) {
  const Result r = run("selfcheck");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("0.049834"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("3/3 match"), std::string::npos) << r.out;
}

TEST(Cli, SchemesListsEveryScheme) {
  const Result r = run("schemes");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* name : {"fp16", "fp8-e4m3", "fp8-e4m3-scaled", "rtn-int8", "rtn-int4", "rtn-2bit", "sign-1bit",
                           "kivi-2bit", "kvquant-4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "rot-4bit"}) {
    const std::string row_start = std::string("\n").append(name).append(" ");
    EXPECT_NE(r.out.find(row_start), std::string::npos) << name << " missing from:\n" << r.out;
  }
  // fp16 at d = 64: 64 values × 2 bytes for keys and for values, ratio 1.
  const std::size_t at = r.out.find("\nfp16 ");
  ASSERT_NE(at, std::string::npos);
  std::istringstream row(r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1));
  std::string name, k_kind, v_kind, k64, v64, ratio64, k128, v128, ratio128;
  row >> name >> k_kind >> v_kind >> k64 >> v64 >> ratio64 >> k128 >> v128 >> ratio128;
  EXPECT_EQ(k_kind, "per-token");
  EXPECT_EQ(k64, "128.00");
  EXPECT_EQ(v64, "128.00");
  EXPECT_EQ(ratio64, "1.00");
  EXPECT_EQ(k128, "256.00");
}

TEST(Cli, UnknownSubcommandFails) { EXPECT_NE(run("frobnicate").exit_code, 0); }

}  // namespace
