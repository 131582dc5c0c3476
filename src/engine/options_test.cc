#include "engine/options.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace witcert::engine {
namespace {

using json = nlohmann::json;

TEST(EngineOptions, JsonGivesTypedValues) {
  const EngineOptions o = EngineOptions::from_json(json::parse(R"({
    "model": "m.gguf", "threads": 3,
    "cache": {"kv": "q8_0", "kv_v": "rtn-int4", "page_size": 32, "outliers": 2, "dither": "per-slot",
              "dither_seed": 18446744073709551615, "delta": 0.001, "bound": "retention", "tau_k": 0.2,
              "tau_v": 0.1, "granularity": "head", "check_soundness": true, "exact_tier": "ram"}})"));
  EXPECT_EQ(o.model, "m.gguf");
  EXPECT_EQ(o.threads, 3);
  const CacheOptions& c = o.cache;
  EXPECT_TRUE(c.certified);
  EXPECT_EQ(c.k_format.name(), "q8_0");
  EXPECT_EQ(c.v_format.name(), "rtn-int4");
  EXPECT_EQ(c.page_size, 32);
  EXPECT_EQ(c.outliers, 2);
  EXPECT_EQ(c.dither, kvcache::DitherMode::per_slot);
  EXPECT_EQ(c.dither_seed, 18446744073709551615ull);
  EXPECT_EQ(c.delta, 0.001);
  EXPECT_EQ(c.bound, cert::BoundShape::retention);
  EXPECT_EQ(c.gate.tau_k(), 0.2);
  EXPECT_EQ(c.gate.tau_v, 0.1);
  EXPECT_EQ(c.gate.granularity, gate::Granularity::head);
  EXPECT_TRUE(c.check_soundness);
  EXPECT_TRUE(c.backing.ram);
  // kv alone sets both sides; no kv is the plain exact cache.
  const CacheOptions one = CacheOptions::from_json(json{{"kv", "kivi-2bit"}});
  EXPECT_EQ(one.v_format.name(), "kivi-2bit");
  EXPECT_FALSE(CacheOptions::from_json(json::object()).certified);
}

TEST(EngineOptions, BadJsonNamesTheSetting) {
  const auto fails = [](const std::string& text, const std::string& says) {
    try {
      EngineOptions::from_json(json::parse(text));
      ADD_FAILURE() << text << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << text << ": " << e.what();
    }
  };
  fails(R"([])", "engine must be a JSON object");
  fails(R"({"threds": 2})", "unknown key 'threds'");
  fails(R"({"threads": 0})", "threads must be in [1, 256]");
  fails(R"({"threads": 2.5})", "threads must be a whole number");
  fails(R"({"threads": "2"})", "threads must be a whole number");
  fails(R"({"threads": 4294967297})", "threads must be a whole number");
  fails(R"({"cache": {"kv": "q9"}})", "unknown KV-cache format 'q9'");
  fails(R"({"cache": {"tau_k": 0.2}})", "tau_k needs kv");
  fails(R"({"cache": {"kv": "q8_0", "tau_k": -1}})", "tau_k must be finite and positive");
  fails(R"({"cache": {"kv": "q8_0", "tau_k": 0.2, "tau_v": 0}})", "tau_v must be finite and positive");
  fails(R"({"cache": {"kv": "q8_0", "delta": 1}})", "delta must be in (0, 1)");
  fails(R"({"cache": {"kv": "q8_0", "page_size": 0}})", "page_size must be in [1, 4096]");
  fails(R"({"cache": {"kv": "dither-int8", "outliers": 32}})", "outliers must be in [0, 31]");
  fails(R"({"cache": {"kv": "q8_0", "dither_seed": -1}})", "dither_seed must be a whole number");
  fails(R"({"cache": {"kv": "q8_0", "granularity": "page"}})", "granularity");
  fails(R"({"cache": {"kv": "q8_0", "bound": "max"}})", "bound");
  fails(R"({"cache": {"kv": "q8_0", "exact_tier": "disk"}})", "exact_tier must be ram or file");
  fails(R"({"cache": {"kv": "q8_0", "check_soundness": 1}})", "check_soundness must be true or false");
  fails(R"({"cache": {"kv": "dither-int8", "dither": "off"}})", "per-slot, shared-page, shared-prompt or none");
  // Every dither mode reads back by its name.
  for (kvcache::DitherMode d : {kvcache::DitherMode::per_slot, kvcache::DitherMode::shared_page,
                              kvcache::DitherMode::shared_prompt, kvcache::DitherMode::none})
    EXPECT_EQ(CacheOptions::from_json({{"kv", "dither-int8"}, {"dither", kvcache::dither_mode_name(d)}}).dither, d);
  // The keys' scale granularity: token by default, channel by name, anything else named in the error.
  EXPECT_EQ(CacheOptions::from_json({{"kv", "dither-int4"}}).key_scales, formats::ScaleGranularity::token);
  EXPECT_EQ(CacheOptions::from_json({{"kv", "dither-int4"}, {"key_scales", "channel"}}).key_scales,
            formats::ScaleGranularity::channel);
  fails(R"({"cache": {"kv": "dither-int8", "key_scales": "block"}})", "unknown scale granularity 'block' (token or channel)");
  fails(R"({"cache": {"kv": "dither-int8", "key_scales": 1}})", "key_scales");
}

// The request-level settings have one reader (the cache options' JSON, the server's `witcert`
// object and batch lines): each key sets its field, an absent key leaves the pool's value, and a
// wrong type or unknown name is an error naming the key.
TEST(CacheOptions, ReadPolicyIsTheOneReaderOfTheRequestSettings) {
  CacheOptions base = CacheOptions::from_json(json::parse(R"({"kv": "q4_0", "tau_k": 0.3, "delta": 0.001})"));
  CacheOptions o = base;
  o.read_policy(json::object());
  EXPECT_EQ(o.gate, base.gate);
  EXPECT_EQ(o.delta, base.delta);
  o.read_policy(json::parse(R"({"tau_k": 0.1, "tau_v": 0.02, "granularity": "head", "delta": 0.05, "bound": "eform"})"));
  EXPECT_EQ(o.gate.tau_k(), 0.1);
  EXPECT_EQ(o.gate.tau_v, 0.02);
  EXPECT_EQ(o.gate.granularity, gate::Granularity::head);
  EXPECT_EQ(o.delta, 0.05);
  EXPECT_EQ(o.bound, cert::BoundShape::eform);
  const CacheOptions from_json = CacheOptions::from_json(
      json::parse(R"({"kv": "q4_0", "tau_k": 0.1, "tau_v": 0.02, "granularity": "head", "delta": 0.05, "bound": "eform"})"));
  EXPECT_EQ(from_json.gate, o.gate);
  EXPECT_EQ(from_json.bound, o.bound);
  for (const char* key : CacheOptions::kPolicyKeys) {
    CacheOptions bad = base;
    try {
      bad.read_policy(json{{key, json::array()}});
      ADD_FAILURE() << key << ": an array was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
  for (const char* body : {R"({"granularity": "page"})", R"({"bound": "loose"})"}) {
    CacheOptions bad = base;
    EXPECT_THROW(bad.read_policy(json::parse(body)), std::invalid_argument) << body;
  }
}

TEST(RequestOptions, JsonAndValidation) {
  const RequestOptions r = RequestOptions::from_json(json::parse(
      R"({"prompt": "hi", "chat": true, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3})"));
  EXPECT_EQ(r.prompt, "hi");
  EXPECT_TRUE(r.chat);
  EXPECT_EQ(r.max_new_tokens, 7);
  EXPECT_FLOAT_EQ(r.sampler.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampler.top_p, 0.9f);
  EXPECT_EQ(r.sampler.seed, 3u);
  for (const char* bad : {R"({})", R"({"prompt": ""})", R"({"prompt": "x", "max_tokens": -1})",
                          R"({"prompt": "x", "max_tokens": 1000001})", R"({"prompt": "x", "temperature": -0.1})",
                          R"({"prompt": "x", "top_p": 0})", R"({"prompt": "x", "top_p": 1.5})",
                          R"({"prompt": "x", "coverage_tau": 0})", R"({"prompt": "x", "coverage_tau_v": 0})",
                          R"({"prompt": "x", "stride": 0})", R"({"prompt": "x", "n": 4})", R"({"prompt": 5})"})
    EXPECT_THROW(RequestOptions::from_json(json::parse(bad)), std::invalid_argument) << bad;
}

// The values a 64-bit integer field must refuse, as JSON text: 2^64, beyond any integer, negative,
// fractional, and a number in a string.
const std::vector<std::string> kBadU64Json = {"18446744073709551616", "1e30", "-1", "1.5", R"("12")"};

TEST(EngineOptions, SeedsBeyondTheirRangeAreErrorsNamingTheField) {
  for (const std::string& v : kBadU64Json) {
    try {
      RequestOptions::from_json(json::parse(R"({"prompt": "x", "seed": )" + v + "}"));
      ADD_FAILURE() << "seed " << v << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("seed must be a whole number"), std::string::npos) << v << ": " << e.what();
    }
    try {
      CacheOptions::from_json(json::parse(R"({"kv": "dither-int8", "dither_seed": )" + v + "}"));
      ADD_FAILURE() << "dither_seed " << v << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("dither_seed must be a whole number"), std::string::npos)
          << v << ": " << e.what();
    }
  }
  // 2^64 - 1 itself is a seed.
  EXPECT_EQ(RequestOptions::from_json(json::parse(R"({"prompt": "x", "seed": 18446744073709551615})")).sampler.seed,
            std::numeric_limits<std::uint64_t>::max());
}

TEST(ParseU64, ReadsDecimalAndHexAndRefusesEverythingElseNamingTheFlag) {
  EXPECT_EQ(parse_u64("0", "--seed"), 0u);
  EXPECT_EQ(parse_u64("010", "--seed"), 10u);  // decimal, not octal
  EXPECT_EQ(parse_u64("0x5EED", "--seed"), 0x5EEDu);
  EXPECT_EQ(parse_u64("18446744073709551615", "--seed"), std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(parse_u64("0xffffffffffffffff", "--seed"), std::numeric_limits<std::uint64_t>::max());
  for (const char* bad : {"18446744073709551616", "99999999999999999999", "0x10000000000000000", "1e30", "-1", "1.5",
                          "\"12\"", "", "0x", "+1", " 1", "1 ", "0b1", "12abc"}) {
    try {
      parse_u64(bad, "--dither-seed");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--dither-seed: '"), std::string::npos) << e.what();
    }
  }
}

// What a witcert command line prints (stdout and stderr) and its exit status.
struct Output {
  int status = -1;
  std::string out;
};

Output run_witcert(const std::string& args) {
  Output r;
  FILE* p = ::popen((std::string(WITCERT_BIN) + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  for (std::size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;) r.out.append(buf.data(), n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

TEST(ParseU64, TheCommandLineRefusesSeedsBeyondTheirRange) {
  for (const char* bad : {"18446744073709551616", "1e30", "-1", "1.5", "'\"12\"'"})
    for (const std::string flag : {"--seed", "--kv dither-int8 --dither-seed"}) {
      const Output r = run_witcert("generate --prompt x " + flag + "=" + bad);
      EXPECT_EQ(r.status, 2) << flag << " " << bad << ": " << r.out;
      const std::string name = flag.substr(flag.rfind(' ') + 1);
      EXPECT_NE(r.out.find(name + ": '"), std::string::npos) << flag << " " << bad << ": " << r.out;
      EXPECT_NE(r.out.find("is not a whole number in [0, 2^64)"), std::string::npos) << r.out;
    }
}

TEST(CoverageTau, AskedElseTheCertifiedGatesElseTheLevelAbove) {
  const gate::Policy none, certified = gate::Policy::from_tau_k(0.1), ranked = gate::Policy::from_tau_k(2.0);
  EXPECT_EQ(coverage_tau(none, std::nullopt), kDefaultCoverageTau);
  EXPECT_EQ(coverage_tau(certified, std::nullopt), 0.1);
  EXPECT_EQ(coverage_tau(ranked, std::nullopt), kDefaultCoverageTau);  // a raw-score gate is no coverage τ
  EXPECT_EQ(coverage_tau(certified, 0.5), 0.5);                         // an explicit τ wins
  EXPECT_EQ(coverage_tau(none, std::nullopt, 0.3), 0.3);
  EXPECT_EQ(coverage_tau(ranked, std::nullopt, 0.3), 0.3);
  EXPECT_EQ(coverage_tau(certified, std::nullopt, 0.3), 0.1);
}

// The τ_K of the coverage figures that `witcert generate` reports for `flags` (NaN: none).
double generate_tau(const std::string& flags) {
  const Output r = run_witcert("generate --prompt 'The capital of France is' --n 3 --kv q4_0 " + flags);
  const std::string key = "coverage at tau_K=";
  const std::size_t at = r.out.find(key);
  if (r.status != 0 || at == std::string::npos) {
    ADD_FAILURE() << "generate " << flags << ": " << r.out;
    return std::numeric_limits<double>::quiet_NaN();
  }
  return std::stod(r.out.substr(at + key.size()));
}

// The τ_K of each result line of `witcert batch` over `lines` with `flags`.
std::vector<double> batch_taus(const std::string& flags, const std::vector<std::string>& lines) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("witcert-coverage-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream in(dir / "in.jsonl");
    for (const std::string& l : lines) in << l << "\n";
  }
  const Output r = run_witcert("batch --kv q4_0 --input " + (dir / "in.jsonl").string() + " --output " +
                            (dir / "out.jsonl").string() + " " + flags);
  std::vector<double> taus;
  std::ifstream out(dir / "out.jsonl");
  for (std::string line; std::getline(out, line);)
    taus.push_back(json::parse(line).at("meter").at("tau_k").get<double>());
  std::filesystem::remove_all(dir);
  EXPECT_EQ(r.status, 0) << r.out;
  return taus;
}

// The server's requests follow the same rule (apps/serve/request_test.cc, Request.CoverageTau...).
TEST(CoverageTau, GenerateAndBatchAgree) {
  const std::string line = R"({"prompt": "The capital of France is", "max_tokens": 3)";
  // A certified gate: its τ_K, from the command line or from the request.
  EXPECT_EQ(generate_tau("--gate 0.1"), 0.1);
  EXPECT_EQ(batch_taus("--gate 0.1", {line + "}"}), std::vector<double>{0.1});
  // An explicit coverage τ wins over the gate's; a raw-score gate leaves the default.
  EXPECT_EQ(generate_tau("--gate 0.1 --coverage-tau 0.5"), 0.5);
  EXPECT_EQ(generate_tau("--gate 2"), kDefaultCoverageTau);
  EXPECT_EQ(batch_taus("--gate 0.1 --coverage-tau 0.5", {line + "}"}), std::vector<double>{0.5});
  // A batch line's own gate and coverage τ, as a server request's.
  EXPECT_EQ(batch_taus("", {line + R"(, "tau_k": 0.1})", line + R"(, "tau_k": 0.1, "coverage_tau": 0.5})",
                            line + R"(, "tau_k": 2})", line + "}"}),
            (std::vector<double>{0.1, 0.5, kDefaultCoverageTau, kDefaultCoverageTau}));
}

}  // namespace
}  // namespace witcert::engine
