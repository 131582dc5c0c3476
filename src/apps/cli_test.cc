// The command-line contracts that external checkers rely on, exercised through the binary.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "base/test_scratch.h"

namespace {

struct Result {
  int exit_code;
  std::string out;
};

std::string scratch(const std::string& name) { return witcert::testing_util::scratch_path("cli_" + name); }

Result run(const std::string& args, const std::string& stdin_text = "") {
  const std::string input = scratch("input.txt");
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

namespace {

const std::string kModel = std::string(WITCERT_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

TEST(CliEngine, GenerateAnswersAChatQuestion) {
  const Result r = run("generate --model " + kModel + " --chat --prompt 'What is the capital of France?' --n 24");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("Paris"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("decode:"), std::string::npos) << "the speed line is missing: " << r.out;
}

TEST(CliEngine, LogitsPrintsTopK) {
  const Result r = run("logits --model " + kModel + " --prompt 'The capital of France is' --top 3");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto o = nlohmann::json::parse(r.out);
  ASSERT_EQ(o["top"].size(), 3u);
  EXPECT_EQ(o["top"][0]["piece"], " Paris");
  EXPECT_GE(o["top"][0]["logit"].get<double>(), o["top"][1]["logit"].get<double>());
}

TEST(CliEngine, ClearErrorsOnBadInput) {
  Result r = run("generate --model /nonexistent/model.gguf --prompt hi");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("does not exist"), std::string::npos) << r.out;

  // A file that is not GGUF.
  const std::string junk = scratch("not_a_model.gguf");
  std::ofstream(junk) << "this is not a model";
  r = run("generate --model " + junk + " --prompt hi");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("GGUF"), std::string::npos) << r.out;

  // A prompt longer than the model's 8192-token context.
  std::string words;
  for (int i = 0; i < 9000; ++i) words += " word";
  const std::string prompt_file = scratch("long_prompt.txt");
  std::ofstream(prompt_file) << words;
  r = run("logits --model " + kModel + " --prompt \"$(cat " + prompt_file + ")\"");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("context"), std::string::npos) << r.out.substr(0, 300);
  r = run("generate --model " + kModel + " --prompt \"$(cat " + prompt_file + ")\"");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("context"), std::string::npos) << r.out.substr(0, 300);

  r = run("generate --model " + kModel + " --prompt hi --top-p 1.5");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("top-p"), std::string::npos) << r.out;
  r = run("generate --model " + kModel + " --prompt hi --temp -1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("temperature"), std::string::npos) << r.out;
}

TEST(CliEngine, DitherSeedAndModeNameTheDitherStream) {
  // The meters depend on the dither: one seed reproduces them exactly, another seed or the
  // shared-page mode changes them. Cells are logged in the order the threads finish: sorted.
  const auto meters = [](const std::string& flags) {
    const std::string file = scratch("meters.jsonl");
    const Result r = run("generate --model " + kModel + " --chat --prompt 'Name three rivers.' --n 4 --kv dither-int8 " +
                         flags + " --meter-json " + file);
    EXPECT_EQ(r.exit_code, 0) << r.out;
    std::ifstream in(file);
    std::vector<std::string> cells;
    for (std::string line; std::getline(in, line);) cells.push_back(line);
    std::sort(cells.begin(), cells.end());
    return cells;
  };
  const std::vector<std::string> a = meters("--dither-seed 11");
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(a == meters("--dither-seed 11"));
  EXPECT_FALSE(a == meters("--dither-seed 12"));
  EXPECT_FALSE(a == meters("--dither-seed 11 --shared-page-dither"));
  // The default shares the prompt's dither: not the per-slot stream, not the shared-page one
  // (the generated tokens have their own), and spelled out it is the same as the default.
  EXPECT_FALSE(a == meters("--dither-seed 11 --dither per-slot"));
  EXPECT_TRUE(a == meters("--dither-seed 11 --dither shared-prompt"));
  EXPECT_FALSE(meters("--dither-seed 11 --dither shared-page") == meters("--dither-seed 11 --dither per-slot"));
  const Result bad = run("generate --model " + kModel + " --prompt 'hi' --n 1 --kv dither-int8 --dither sideways");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("unknown dither mode"), std::string::npos) << bad.out;
}

TEST(CliEngine, SeededSamplingIsReproducible) {
  const std::string cmd = "generate --model " + kModel + " --prompt 'Once upon a time' --n 16 --temp 0.8 --top-p 0.9 --seed 7";
  const Result a = run(cmd), b = run(cmd);
  ASSERT_EQ(a.exit_code, 0) << a.out;
  const auto text = [](const std::string& s) { return s.substr(0, s.find("prefill:")); };
  EXPECT_EQ(text(a.out), text(b.out));
}

}  // namespace

namespace {

TEST(CliEngine, RunWritesAReportAndGatesWithinTau) {
  const std::string dir = scratch("report");
  const Result r = run("run --model " + kModel + " --kv q4_0 --gate 0.2 --n 4 --check-soundness --report " + dir +
                       " 'The capital of France is'");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("certified tau=0.2 block"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", 0 violations"), std::string::npos) << r.out;
  std::ifstream json(dir + "/report.json");
  ASSERT_TRUE(json.good());
  const auto j = nlohmann::json::parse(json);
  ASSERT_EQ(j["runs"].size(), 1u);
  EXPECT_GE(j["runs"][0]["meter"]["coverage"].get<double>(), 1.0) << "every served cell within tau";
  EXPECT_TRUE(std::ifstream(dir + "/report.md").good());
  EXPECT_TRUE(std::ifstream(dir + "/heatmap-1.svg").good());
  // The telemetry's JSON lines: every decode-step cell (stride 1), each within tau as served.
  std::ifstream jl(dir + "/meter-1.jsonl");
  std::string line;
  std::int64_t n = 0;
  while (std::getline(jl, line)) {
    const auto c = nlohmann::json::parse(line);
    EXPECT_LE(c["meter"].get<double>(), 0.2) << line;
    ++n;
  }
  EXPECT_EQ(n, j["runs"][0]["meter"]["cells"].get<std::int64_t>());
}

// The main job on a short haystack: every run of the table, certified gating serving every cell
// within its τ, and the certified cache paging in less than the damaging one.
TEST(CliEngine, DemoPrintsItsTableAndGatesWithinTau) {
  const std::string dir = scratch("demo");
  const Result r = run("demo --model " + kModel + " --tokens 200 --report " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("fp16 answer: "), std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(std::ifstream(dir + "/report.json"));
  EXPECT_NE(j["fp16_text"].get<std::string>().find("orange-falcon-17"), std::string::npos) << j["fp16_text"];
  ASSERT_EQ(j["runs"].size(), 6u);
  std::map<std::string, nlohmann::json> runs;
  for (const auto& run : j["runs"]) {
    EXPECT_TRUE(run.contains("answer_correct"));
    EXPECT_NE(r.out.find(run["label"].get<std::string>()), std::string::npos) << "missing from the table";
    // Only a dither-int8 run has a dither; the demo's is the default.
    if (run["kv_k"] == "dither-int8")
      EXPECT_EQ(run["dither"], "shared-prompt");
    else
      EXPECT_FALSE(run.contains("dither")) << run["label"];
    runs[run["label"]] = run;
  }
  EXPECT_EQ(runs["fp8-e4m3 gated"]["meter"]["coverage"].get<double>(), 1.0);   // τ = 0.2
  EXPECT_EQ(runs["dither-int8 gated"]["meter"]["coverage"].get<double>(), 1.0);
  EXPECT_EQ(runs["q4_0 raw"]["page_in_bytes"].get<std::int64_t>(), 0);
  EXPECT_GT(runs["q4_0 gated"]["page_in_bytes"].get<std::int64_t>(), 0);
  EXPECT_LT(runs["dither-int8 gated"]["page_in_bytes"].get<std::int64_t>(),
            runs["q4_0 gated"]["page_in_bytes"].get<std::int64_t>());
}

// The exact tier in a memory-mapped file serves the same repairs as in RAM.
TEST(CliEngine, RunWithAFileBackedTierMatchesRam) {
  const std::string ram = scratch("ram"), file = scratch("file"), tier = scratch("tier.bin");
  const std::string args = "run --model " + kModel + " --kv q4_0 --gate 0.2 --n 4 'The capital of France is' --report ";
  ASSERT_EQ(run(args + ram).exit_code, 0);
  ASSERT_EQ(run(args + file + " --backing-file " + tier).exit_code, 0);
  const auto a = nlohmann::json::parse(std::ifstream(ram + "/report.json"))["runs"][0];
  const auto b = nlohmann::json::parse(std::ifstream(file + "/report.json"))["runs"][0];
  EXPECT_EQ(a["text"], b["text"]);
  EXPECT_EQ(a["page_in_bytes"], b["page_in_bytes"]);
  EXPECT_GT(b["page_in_bytes"].get<std::int64_t>(), 0);
  EXPECT_EQ(a["meter"]["coverage"], b["meter"]["coverage"]);
  EXPECT_EQ(a["kl_vs_fp16"], b["kl_vs_fp16"]);
}

TEST(CliEngine, RunRejectsBadArguments) {
  EXPECT_NE(run("run --model " + kModel + " --kv nope 'hi'").exit_code, 0);
  EXPECT_NE(run("run --model " + kModel + " --kv q8_0 --gate -1 'hi'").exit_code, 0);
  const Result zero = run("run --model " + kModel + " --kv q8_0 --gate 0 'hi'");
  EXPECT_NE(zero.exit_code, 0);
  EXPECT_NE(zero.out.find("tau must be positive"), std::string::npos) << zero.out;
  EXPECT_NE(run("run --model " + kModel + " --kv q8_0 --delta 2 'hi'").exit_code, 0);
  EXPECT_NE(run("run --model " + kModel + " --kv q8_0 --granularity page 'hi'").exit_code, 0);
  EXPECT_NE(run("run --model " + kModel + " --kv q8_0 --telemetry-stride 0 'hi'").exit_code, 0);
  const Result missing = run("run --model /nonexistent/model.gguf --kv q8_0 'hi'");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.out.find("/nonexistent/model.gguf"), std::string::npos) << missing.out;
  const Result too_long = run("run --model " + kModel + " --kv q8_0 --n 9000 'hi'");
  EXPECT_NE(too_long.exit_code, 0);
  EXPECT_NE(too_long.out.find("context"), std::string::npos) << too_long.out;
  EXPECT_NE(run("demo --model " + kModel + " --tokens 10").exit_code, 0);
}

}  // namespace
