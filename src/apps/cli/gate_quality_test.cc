// Gated never worse than raw, on the real model through the `witcert run` command line: for every
// format of the registry and dither-int8, on a fixed prompt, the gated run's teacher-forced KL
// against fp16 (τ = 0.2, block) is below the raw run's wherever the raw run's exceeds 1e-3, and
// within 1e-3 of it elsewhere; every gated cell passes jointly.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "base/test_scratch.h"
#include "formats/schemes.h"

namespace {

const std::string kModel = std::string(WITCERT_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
constexpr const char* kPrompt =
    "The river flows slowly through the valley, past farms and old stone bridges. In the spring the orchards bloom, "
    "and the air smells of apples and cut grass. Merchants once carried salt and wool along this road to the coastal "
    "towns. The library keeps maps of the region drawn by surveyors two centuries ago. Question: what do the "
    "merchants carry? Answer:";

// KL against fp16 per run label, from the report of one `witcert run --scheme-sweep`.
std::map<std::string, nlohmann::json> sweep(const std::string& formats, const std::string& flags, const std::string& dir) {
  const std::string cmd = std::string(WITCERT_BIN) + " run --model " + kModel + " --n 8 --scheme-sweep " + formats +
                          " " + flags + " --report " + dir + " '" + kPrompt + "' > " + dir + ".log 2>&1";
  const int status = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cmd;
  std::ifstream f(dir + "/report.json");
  const nlohmann::json report = nlohmann::json::parse(f);
  std::map<std::string, nlohmann::json> runs;
  for (const nlohmann::json& r : report["runs"]) runs[r["kv_k"].get<std::string>()] = r;
  return runs;
}

TEST(GateQuality, GatedIsNeverWorseThanRawForEveryFormat) {
  ASSERT_TRUE(std::filesystem::exists(kModel)) << "the real model is missing: run scripts/fetch-model.sh";
  std::string formats = "dither-int8";
  for (const std::string& s : witcert::formats::kv_scheme_names())
    if (s != "fp16") formats += "," + s;
  const auto raw = sweep(formats, "", witcert::testing_util::scratch_path("quality_raw"));
  const auto gated = sweep(formats, "--gate 0.2 --granularity block", witcert::testing_util::scratch_path("quality_gated"));
  ASSERT_EQ(raw.size(), gated.size());
  ASSERT_EQ(raw.size(), witcert::formats::kv_scheme_names().size());  // every scheme but fp16, and dither-int8
  for (const auto& [name, r] : raw) {
    const nlohmann::json& g = gated.at(name);
    const double kl_raw = r["kl_vs_fp16"].get<double>(), kl_gated = g["kl_vs_fp16"].get<double>();
    std::printf("[gate-quality] %-16s raw KL %.5f  gated KL %.5f  joint coverage %.3f -> %.3f  page-in %lld B\n",
                name.c_str(), kl_raw, kl_gated, r["meter"]["coverage"]["joint"].get<double>(),
                g["meter"]["coverage"]["joint"].get<double>(), g["page_in_bytes"].get<long long>());
    if (kl_raw > 1e-3)
      EXPECT_LT(kl_gated, kl_raw) << name;
    else
      EXPECT_LE(kl_gated, kl_raw + 1e-3) << name;
    EXPECT_EQ(g["meter"]["coverage"]["joint"].get<double>(), 1.0) << name;
    EXPECT_EQ(g["bound"], "min") << name;
  }
}

}  // namespace
