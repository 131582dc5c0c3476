#include "apps/serve/request.h"

#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace witcert::apps {
namespace {

using nlohmann::json;

RequestDefaults pool(const char* cache) {
  RequestDefaults d;
  d.model_name = "smollm2";
  d.max_tokens = 16;
  d.cache = engine::CacheOptions::from_json(json::parse(cache));
  return d;
}

const RequestDefaults& certified() {
  static const RequestDefaults d = pool(R"({"kv": "dither-int8"})");
  return d;
}

json base(bool chat) {
  return chat ? json{{"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})}} : json{{"prompt", "Hi"}};
}

// The body's error, or a failure when the body is accepted.
ApiError refused(const std::string& body, bool chat, const RequestDefaults& d = certified()) {
  try {
    parse_request(body, chat, d);
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted: " << body;
  return ApiError(0, "");
}

TEST(Request, AWellFormedBodyGivesEveryField) {
  const json body = {{"prompt", "The capital of France is"}, {"max_tokens", 8}, {"temperature", 0.5}, {"top_p", 0.9},
                     {"seed", 7}, {"stop", {"\n", "."}}, {"stream", true}, {"stream_options", {{"include_usage", false}}},
                     {"logprobs", 2}, {"model", "smollm2"}, {"witcert", {{"tau_k", 0.3}, {"granularity", "block"}, {"detail", true}}}};
  const RequestSpec s = parse_request(body.dump(), false, certified());
  EXPECT_FALSE(s.chat);
  EXPECT_EQ(s.prompt, "The capital of France is");
  EXPECT_EQ(s.req.max_tokens, 8);
  EXPECT_FLOAT_EQ(s.req.sampler.temperature, 0.5f);
  EXPECT_FLOAT_EQ(s.req.sampler.top_p, 0.9f);
  EXPECT_EQ(s.req.sampler.seed, 7u);
  EXPECT_EQ(s.stop, (std::vector<std::string>{"\n", "."}));
  EXPECT_TRUE(s.stream);
  EXPECT_FALSE(s.include_usage);
  EXPECT_TRUE(s.logprobs);
  EXPECT_EQ(s.top_logprobs, 2);
  EXPECT_TRUE(s.detail);
  EXPECT_DOUBLE_EQ(s.req.cache.gate.tau_k(), 0.3);
  EXPECT_EQ(s.req.cache.gate.granularity, gate::Granularity::block);
  EXPECT_DOUBLE_EQ(s.req.coverage_tau, 0.3);  // the gate's τ is the coverage τ
  EXPECT_TRUE(s.req.prompt.empty());           // tokens come from the model, later

  const RequestSpec c = parse_request(base(true).dump(), true, certified());
  ASSERT_EQ(c.messages.size(), 1u);
  EXPECT_EQ(c.messages[0].role, "user");
  EXPECT_EQ(c.req.max_tokens, 16);  // the server's default
  EXPECT_EQ(c.top_logprobs, -1);
}

TEST(Request, EveryFieldOfTheWrongTypeIsRefusedByName) {
  // Each field with a value of a type it never takes, on both endpoints where it exists.
  const std::vector<std::pair<std::string, json>> wrong = {
      {"model", 3},          {"max_tokens", "9"},        {"max_tokens", 2.5},   {"temperature", "hot"},
      {"top_p", json::array()}, {"seed", -1},             {"seed", 0.5},         {"stop", 5},
      {"stop", {1}},         {"stream", "yes"},           {"stream_options", 1}, {"n", "1"},
      {"user", 5},           {"presence_penalty", "0"},   {"frequency_penalty", true}, {"witcert", 0.2},
      {"logprobs", "x"},     {"top_k", "3"},             {"top_k", 1.5}};
  for (bool chat : {false, true})
    for (const auto& [key, value] : wrong) {
      json body = base(chat);
      body[key] = value;
      const ApiError e = refused(body.dump(), chat);
      EXPECT_EQ(e.status, 400) << body.dump();
      EXPECT_EQ(e.param, key) << body.dump() << " → " << e.what();
    }
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{{"prompt", 5}, {"prompt", json::parse(R"([["a"]])")}}) {
    json body = {{key, value}};
    EXPECT_EQ(refused(body.dump(), false).param, "prompt");
  }
  for (const json& m : {json("Hi"), json::array({"Hi"}), json::array({{{"role", "user"}}}),
                        json::array({{{"role", 1}, {"content", "Hi"}}}), json::array({{{"role", "tool"}, {"content", "Hi"}}}),
                        json::array({{{"role", "user"}, {"content", json::array()}}})}) {
    EXPECT_EQ(refused(json{{"messages", m}}.dump(), true).param, "messages") << m.dump();
  }
}

// top_k as vLLM and llama-server take it: -1 and 0 keep every token, k ≥ 1 the k most likely.
TEST(Request, TopKAsVllmTakesIt) {
  for (const auto& [given, kept] : std::vector<std::pair<int, int>>{{-1, 0}, {0, 0}, {1, 1}, {40, 40}}) {
    const RequestSpec s = parse_request(json{{"prompt", "Hi"}, {"top_k", given}}.dump(), false, certified());
    EXPECT_EQ(s.req.sampler.top_k, kept) << given;
  }
  EXPECT_EQ(parse_request(R"({"prompt": "Hi"})", false, certified()).req.sampler.top_k, 0);
  EXPECT_EQ(refused(R"({"prompt": "Hi", "top_k": -2})", false).param, "top_k");
}

// OpenAI's prompt shapes: a string, a list of one string, token ids, a list of one list of token
// ids; several prompts and anything else are refused naming `prompt`. Chat content as text parts
// is joined by newlines; other parts, empty parts and parts without text are refused.
TEST(Request, PromptShapesAndContentParts) {
  const auto parsed = [](const json& prompt) { return parse_request(json{{"prompt", prompt}}.dump(), false, certified()); };
  for (const json& p : {json("Hi there"), json::array({"Hi there"})}) {
    const RequestSpec s = parsed(p);
    EXPECT_EQ(s.prompt, "Hi there") << p;
    EXPECT_FALSE(s.prompt_is_ids);
  }
  for (const json& p : {json::parse("[1, 22, 333]"), json::parse("[[1, 22, 333]]")}) {
    const RequestSpec s = parsed(p);
    EXPECT_TRUE(s.prompt_is_ids) << p;
    EXPECT_EQ(s.prompt_ids, (std::vector<std::int32_t>{1, 22, 333})) << p;
  }
  EXPECT_TRUE(parsed(json::array()).prompt_ids.empty());  // the server refuses it as an empty prompt
  for (const char* several : {R"(["a", "b"])", R"([[1], [2]])", R"([[1], "b"])"}) {
    const ApiError e = refused(json{{"prompt", json::parse(several)}}.dump(), false);
    EXPECT_EQ(e.param, "prompt") << several;
    EXPECT_EQ(e.code, "unsupported_parameter") << several;
  }
  for (const char* bad : {"[1.5]", "[-1]", "[true]", "[2147483648]", "[1, \"a\"]", "{\"a\": 1}", "[[\"a\"]]", "[[1.5]]", "null"}) {
    const ApiError e = refused(R"({"prompt": )" + std::string(bad) + "}", false);
    EXPECT_EQ(e.param, "prompt") << bad;
  }

  const auto chat = [](const json& content) {
    return json{{"messages", json::array({{{"role", "user"}, {"content", content}}})}}.dump();
  };
  const RequestSpec s = parse_request(chat(json::parse(R"([{"type": "text", "text": "Name"}, {"type": "text", "text": "a color."}])")),
                                      true, certified());
  ASSERT_EQ(s.messages.size(), 1u);
  EXPECT_EQ(s.messages[0].content, "Name\na color.");
  for (const char* bad : {R"([])", R"([{"type": "image_url", "image_url": {"url": "x"}}])", R"([{"type": "text"}])",
                          R"([{"type": "text", "text": 5}])", R"(["text"])", R"([{"text": "x"}])"}) {
    const ApiError e = refused(chat(json::parse(bad)), true);
    EXPECT_EQ(e.param, "messages") << bad;
  }
}

TEST(Request, EveryRangeIsCheckedAtBothEnds) {
  struct Case {
    std::string key;
    json in_low, in_high, out_low, out_high;
  };
  const std::vector<Case> cases = {
      {"max_tokens", 1, 1000000, 0, 1000001},
      {"temperature", 0, 2, -0.001, 2.001},
      {"top_p", 1e-9, 1, 0, 1.001},
  };
  for (bool chat : {false, true})
    for (const Case& c : cases) {
      for (const json& v : {c.in_low, c.in_high}) {
        json body = base(chat);
        body[c.key] = v;
        EXPECT_NO_THROW(parse_request(body.dump(), chat, certified())) << body.dump();
      }
      for (const json& v : {c.out_low, c.out_high}) {
        json body = base(chat);
        body[c.key] = v;
        EXPECT_EQ(refused(body.dump(), chat).param, c.key) << body.dump();
      }
    }
  // logprobs: 0..5 on completions; top_logprobs 0..20 on chat, and only with logprobs.
  EXPECT_NO_THROW(parse_request(R"({"prompt": "x", "logprobs": 5})", false, certified()));
  EXPECT_EQ(refused(R"({"prompt": "x", "logprobs": 6})", false).param, "logprobs");
  EXPECT_EQ(refused(R"({"prompt": "x", "logprobs": -1})", false).param, "logprobs");
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  EXPECT_NO_THROW(parse_request("{" + msgs + R"(, "logprobs": true, "top_logprobs": 20})", true, certified()));
  EXPECT_EQ(refused("{" + msgs + R"(, "logprobs": true, "top_logprobs": 21})", true).param, "top_logprobs");
  EXPECT_EQ(refused("{" + msgs + R"(, "top_logprobs": 2})", true).param, "top_logprobs");
  // stop: at most four, none empty.
  EXPECT_NO_THROW(parse_request(R"({"prompt": "x", "stop": ["a", "b", "c", "d"]})", false, certified()));
  EXPECT_EQ(refused(R"({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]})", false).param, "stop");
  EXPECT_EQ(refused(R"({"prompt": "x", "stop": ""})", false).param, "stop");
  // Numbers JSON cannot hold as the field's type.
  EXPECT_EQ(refused(R"({"prompt": "x", "max_tokens": 4294967301})", false).param, "max_tokens");
  EXPECT_EQ(refused(R"({"prompt": "x", "n": 18446744073709551615})", false).param, "n");
  EXPECT_EQ(refused(R"({"prompt": "x", "temperature": 1e999})", false).code, "invalid_json");
}

TEST(Request, UnsupportedFieldsAreNamedNotIgnored) {
  for (const char* key : {"tools", "tool_choice", "response_format", "functions", "best_of", "suffix", "logit_bias"}) {
    json body = base(true);
    body[key] = nullptr;
    const ApiError e = refused(body.dump(), true);
    EXPECT_EQ(e.param, key);
    EXPECT_EQ(e.code, "unsupported_parameter");
  }
  // Endpoint-specific fields on the other endpoint.
  EXPECT_EQ(refused(R"({"prompt": "x", "messages": []})", false).param, "messages");
  EXPECT_EQ(refused(R"({"messages": [{"role": "user", "content": "x"}], "prompt": "x"})", true).param, "prompt");
  EXPECT_EQ(refused(R"({"prompt": "x", "n": 2})", false).param, "n");
  EXPECT_EQ(refused(R"({"prompt": "x", "echo": true})", false).param, "echo");
  EXPECT_EQ(refused(R"({"prompt": "x", "presence_penalty": 0.5})", false).param, "presence_penalty");
  EXPECT_EQ(refused(R"({"prompt": "x", "model": "gpt-4"})", false).code, "model_not_found");
  EXPECT_EQ(refused(R"({"prompt": "x", "stream_options": {"chunk": 1}})", false).param, "stream_options");
  EXPECT_EQ(refused(R"({"prompt": "x", "stream_options": {"include_usage": 1}})", false).param,
            "stream_options.include_usage");
}

TEST(Request, TheMeterPolicyIsValidatedAgainstThePool) {
  const RequestDefaults plain = pool("{}");
  const RequestDefaults gated = pool(R"({"kv": "q8_0", "kv_v": "q4_0", "tau_k": 0.2})");
  for (const char* w : {R"({"tau_k": 0.1})", R"({"tau_v": 0.1})", R"({"granularity": "head"})", R"({"delta": 0.001})",
                        R"({"bound": "tanh"})", R"({"coverage_tau": 0.5})", R"({"coverage_tau_v": 0.5})"}) {
    const std::string body = std::string(R"({"prompt": "x", "witcert": )") + w + "}";
    EXPECT_NO_THROW(parse_request(body, false, certified())) << body;
    if (std::string(w).find("delta") == std::string::npos) {
      EXPECT_NO_THROW(parse_request(body, false, gated)) << body;
    }
    EXPECT_EQ(refused(body, false, plain).param, "witcert") << body;  // a plain pool has no meter
  }
  // δ changes only dither-int8 keys' bound: on q8_0 keys it is refused, not ignored.
  const ApiError no_delta = refused(R"({"prompt": "x", "witcert": {"delta": 0.001}})", false, gated);
  EXPECT_EQ(no_delta.param, "witcert");
  EXPECT_NE(std::string(no_delta.what()).find("the pool's keys are q8_0"), std::string::npos) << no_delta.what();
  for (const char* w : {R"({"tau_k": -0.1})", R"({"tau_k": "0.1"})", R"({"tau_v": -1})", R"({"granularity": "page"})",
                        R"({"delta": 0})", R"({"delta": 1})", R"({"bound": "max"})", R"({"coverage_tau": 0})",
                        R"({"coverage_tau": 1.5})", R"({"coverage_tau_v": 0})", R"({"detail": 1})", R"(0.2)"}) {
    const std::string body = std::string(R"({"prompt": "x", "witcert": )") + w + "}";
    const ApiError e = refused(body, false, gated);
    EXPECT_TRUE(e.param == "witcert" || e.param == "witcert.detail") << body << " → " << e.param;
  }
  EXPECT_EQ(refused(R"({"prompt": "x", "witcert": {"tua": 0.1}})", false).param, "witcert.tua");
  // detail alone is not a policy: a plain pool takes it.
  EXPECT_TRUE(parse_request(R"({"prompt": "x", "witcert": {"detail": true}})", false, plain).detail);
}

TEST(Request, MalformedBodiesGetAJsonErrorBody) {
  // Truncations, non-objects and bytes that are not UTF-8: every error body is valid JSON with the
  // message, because the parser's message quotes the bytes it last read.
  const std::string good = R"({"prompt": "caf\u00e9", "max_tokens": 3})";
  std::vector<std::string> bodies = {"", " ", "null", "[]", "\"x\"", "1", "{", "{\"prompt\"", "\xff", "\xc3",
                                     std::string("{\"prompt\": \"\xc3\"}"), std::string("{\"\xff\": 1}"),
                                     std::string("\0{}", 3), "{\"prompt\": \"x\"} trailing"};
  for (std::size_t n = 0; n < good.size(); ++n) bodies.push_back(good.substr(0, n));
  for (bool chat : {false, true})
    for (const std::string& b : bodies) {
      const ApiError e = refused(b, chat);
      EXPECT_EQ(e.status, 400);
      json back;
      ASSERT_NO_THROW(back = json::parse(error_text(e))) << b;
      EXPECT_FALSE(back.at("error").at("message").get<std::string>().empty());
      EXPECT_EQ(back.at("error").at("type"), "invalid_request_error");
    }
  EXPECT_EQ(parse_request(good, false, certified()).prompt, "caf\xc3\xa9");
}

TEST(Request, ErrorBodiesFollowOpenAi) {
  const json e = json::parse(error_text(ApiError(401, "no key", "", "invalid_api_key")));
  EXPECT_EQ(e.at("error").at("type"), "authentication_error");
  EXPECT_TRUE(e.at("error").at("param").is_null());
  EXPECT_EQ(e.at("error").at("code"), "invalid_api_key");
  EXPECT_EQ(json::parse(error_text(ApiError(503, "busy"))).at("error").at("type"), "server_error");
  EXPECT_TRUE(json::parse(error_text(ApiError(503, "busy"))).at("error").at("code").is_null());
  EXPECT_EQ(json::parse(error_text(ApiError(400, "bad", "top_p"))).at("error").at("param"), "top_p");
}

// A body nested past the limit is refused at parse time wherever the nesting sits (the top level,
// every field that takes a value, inside a message), as arrays or objects, and just past the limit
// as well as far past it; one level less is parsed (and refused or taken by the field's own rules).
TEST(Request, NestingBeyondTheLimitIsRefusedWhereverItIs) {
  const auto nest = [](int depth, bool arrays) {
    std::string s;
    for (int i = 0; i < depth; ++i) s += arrays ? "[" : "{\"a\":";
    s += arrays ? "" : "1";
    for (int i = 0; i < depth; ++i) s += arrays ? "]" : "}";
    return s;
  };
  const std::vector<std::string> completion_fields = {"prompt", "max_tokens", "stop", "user", "witcert", "seed",
                                                       "stream_options", "logprobs"};
  int refused_deep = 0;
  for (const int depth : {65, 66, 1000, 60000})
    for (const bool arrays : {true, false})
      for (const bool chat : {false, true}) {
        std::vector<std::string> bodies = {nest(depth, arrays)};
        for (const std::string& f : completion_fields)
          bodies.push_back((chat ? R"({"messages": [{"role": "user", "content": "Hi"}], ")" : R"({"prompt": "Hi", ")") +
                           f + "\": " + nest(depth - 1, arrays) + "}");
        if (chat)
          bodies.push_back(R"({"messages": [{"role": "user", "content": )" + nest(depth - 3, arrays) + "}]}");
        for (const std::string& body : bodies) {
          const ApiError e = refused(body, chat);
          EXPECT_EQ(e.status, 400);
          EXPECT_EQ(e.code, "invalid_json") << body.substr(0, 80);
          EXPECT_NE(std::string(e.what()).find("nests deeper than 64"), std::string::npos) << e.what();
          ++refused_deep;
        }
      }
  EXPECT_EQ(refused_deep, 4 * 2 * (1 + 8) + 4 * 2 * (1 + 8 + 1));
  // 64 levels in all parse: the field's own rules answer (a nested `user` is a wrong type).
  const ApiError shallow = refused(R"({"prompt": "Hi", "user": )" + nest(63, true) + "}", false);
  EXPECT_EQ(shallow.code, "invalid_type") << shallow.what();
}

// A request's coverage τ by the engine's one rule, as `witcert generate` and `witcert batch` report
// it for the same settings (engine/options_test.cc, CoverageTau.GenerateAndBatchAgree): its own
// coverage τ, else its certified gate's τ_K, else the server's.
TEST(Request, CoverageTauFollowsTheEngineRule) {
  RequestDefaults d;
  d.cache.certified = true;
  d.cache.k_format = d.cache.v_format = formats::KvFormat::parse("q4_0");
  d.coverage_tau = engine::coverage_tau(d.cache.gate, std::nullopt);
  const auto tau = [&](const std::string& witcert) {
    return parse_request(R"({"prompt": "x", "witcert": )" + witcert + "}", false, d).req.coverage_tau;
  };
  EXPECT_EQ(tau(R"({"tau_k": 0.1})"), 0.1);
  EXPECT_EQ(tau(R"({"tau_k": 0.1, "coverage_tau": 0.5})"), 0.5);
  EXPECT_EQ(tau(R"({"tau_k": 2})"), engine::kDefaultCoverageTau);
  EXPECT_EQ(tau("{}"), engine::kDefaultCoverageTau);
}

}  // namespace
}  // namespace witcert::apps
