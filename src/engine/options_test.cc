#include "engine/options.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace witcert::engine {
namespace {

using json = nlohmann::json;

TEST(EngineOptions, JsonGivesTypedValues) {
  const EngineOptions o = EngineOptions::from_json(json::parse(R"({
    "model": "m.gguf", "threads": 3,
    "cache": {"kv": "q8_0", "kv_v": "rtn-int4", "page_size": 32, "outliers": 2, "dither": "per-slot",
              "dither_seed": 18446744073709551615, "delta": 0.001, "bound": "retention", "gate": 0.2,
              "tau_v": 0.1, "granularity": "head", "check_soundness": true, "exact_tier": "ram"}})"));
  EXPECT_EQ(o.model, "m.gguf");
  EXPECT_EQ(o.threads, 3);
  const CacheOptions& c = o.cache;
  EXPECT_TRUE(c.certified);
  EXPECT_EQ(c.k_format.name(), "q8_0");
  EXPECT_EQ(c.v_format.name(), "rtn-int4");
  EXPECT_EQ(c.page_size, 32);
  EXPECT_EQ(c.outliers, 2);
  EXPECT_EQ(c.dither, cache::DitherMode::per_slot);
  EXPECT_EQ(c.dither_seed, 18446744073709551615ull);
  EXPECT_EQ(c.delta, 0.001);
  EXPECT_EQ(c.bound, cert::BoundShape::retention);
  EXPECT_EQ(c.gate.tau_k, 0.2);
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
  fails(R"({"cache": {"gate": 0.2}})", "gate needs kv");
  fails(R"({"cache": {"kv": "q8_0", "gate": -1}})", "tau must be finite and positive");
  fails(R"({"cache": {"kv": "q8_0", "gate": 0.2, "tau_v": 0}})", "tau_v must be finite and positive");
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
  for (cache::DitherMode d : {cache::DitherMode::per_slot, cache::DitherMode::shared_page,
                              cache::DitherMode::shared_prompt, cache::DitherMode::none})
    EXPECT_EQ(CacheOptions::from_json({{"kv", "dither-int8"}, {"dither", cache::dither_mode_name(d)}}).dither, d);
}

TEST(RequestOptions, JsonAndValidation) {
  const RequestOptions r = RequestOptions::from_json(json::parse(
      R"({"prompt": "hi", "chat": true, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stride": 2})"));
  EXPECT_EQ(r.prompt, "hi");
  EXPECT_TRUE(r.chat);
  EXPECT_EQ(r.max_new_tokens, 7);
  EXPECT_FLOAT_EQ(r.sampler.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampler.top_p, 0.9f);
  EXPECT_EQ(r.sampler.seed, 3u);
  EXPECT_EQ(r.stride, 2);
  for (const char* bad : {R"({})", R"({"prompt": ""})", R"({"prompt": "x", "max_tokens": -1})",
                          R"({"prompt": "x", "max_tokens": 1000001})", R"({"prompt": "x", "temperature": -0.1})",
                          R"({"prompt": "x", "top_p": 0})", R"({"prompt": "x", "top_p": 1.5})",
                          R"({"prompt": "x", "coverage_tau": 0})", R"({"prompt": "x", "coverage_tau_v": 0})",
                          R"({"prompt": "x", "stride": 0})", R"({"prompt": "x", "n": 4})", R"({"prompt": 5})"})
    EXPECT_THROW(RequestOptions::from_json(json::parse(bad)), std::invalid_argument) << bad;
}

}  // namespace
}  // namespace witcert::engine
