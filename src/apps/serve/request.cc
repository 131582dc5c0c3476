#include "apps/serve/request.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <cmath>

namespace witcert::apps {

using nlohmann::json;

ApiError::ApiError(int s, const std::string& message, std::string p, std::string c, std::string t)
    : std::runtime_error(message),
      status(s),
      type(t.empty() ? (s == 401 ? "authentication_error" : s >= 500 ? "server_error" : "invalid_request_error") : t),
      param(std::move(p)),
      code(std::move(c)) {}

json error_json(const ApiError& e) {
  return {{"error",
           {{"message", e.what()},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

std::string json_text(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_text(const ApiError& e) { return json_text(error_json(e)); }

namespace {

// A field of the body, typed as engine::read_json reads it (absent or null leaves `out` as it is);
// a wrong type or a number beyond the field's range is a 400 naming the field.
// `param` names a nested field ("witcert.detail"); by default the key itself.
template <class T>
void field(const json& body, const char* key, T& out, const char* param = nullptr) {
  if (!body.contains(key) || body.at(key).is_null()) return;
  try {
    engine::read_json(body, key, out);
  } catch (const std::invalid_argument& e) {
    throw ApiError(400, e.what(), param ? param : key, "invalid_type");
  }
}

void require(bool ok, const std::string& message, const std::string& param, const std::string& code = "invalid_value") {
  if (!ok) throw ApiError(400, message, param, code);
}

void require_arg(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

}  // namespace

std::vector<model::ChatMessage> chat_messages(const json& msgs) {
  require_arg(msgs.is_array() && !msgs.empty(), "'messages' must be a non-empty array");
  std::vector<model::ChatMessage> turns;
  for (const json& t : msgs) {
    require_arg(t.is_object() && t.contains("role") && t.at("role").is_string() && t.contains("content") &&
                    (t.at("content").is_string() || t.at("content").is_array()),
                "each message is an object with a string role and a content that is a string or an array of parts");
    const std::string role = t.at("role").get<std::string>();
    require_arg(role == "system" || role == "user" || role == "assistant",
                "a message's role is system, user or assistant, got '" + role + "'");
    const json& content = t.at("content");
    if (content.is_string()) {
      turns.push_back({role, content.get<std::string>()});
      continue;
    }
    // Content parts: the text parts joined by newlines, as vLLM joins them; no other kind is read.
    require_arg(!content.empty(), "a message's content parts must not be empty");
    std::string text;
    for (const json& part : content) {
      require_arg(part.is_object() && part.contains("type") && part.at("type").is_string(),
                  "each content part is an object with a string type");
      const std::string type = part.at("type").get<std::string>();
      require_arg(type == "text", "a content part of type '" + type + "' is not supported (only text)");
      require_arg(part.contains("text") && part.at("text").is_string(), "a text part has a string 'text'");
      if (&part != &content.front()) text += "\n";
      text += part.at("text").get<std::string>();
    }
    turns.push_back({role, text});
  }
  return turns;
}

namespace {

// The body as a JSON object.
json parse_object(std::string_view text) {
  json body;
  try {
    body = engine::parse_json(text);
  } catch (const std::invalid_argument& e) {
    throw ApiError(400, std::string("the body is not accepted: ") + e.what(), "", "invalid_json");
  }
  require(body.is_object(), "the body must be a JSON object", "");
  return body;
}

// The body as a JSON object whose keys are all in `keys`.
json object_body(std::string_view text, const std::vector<std::string>& keys) {
  json body = parse_object(text);
  for (const auto& item : body.items())
    if (std::find(keys.begin(), keys.end(), item.key()) == keys.end())
      throw ApiError(400, fmt::format("'{}' is not supported by this endpoint", item.key()), item.key(),
                     "unsupported_parameter");
  return body;
}

}  // namespace

TokenizeSpec parse_tokenize(std::string_view text) {
  const json body = object_body(text, {"content", "add_special", "parse_special", "with_pieces"});
  require(body.contains("content") && body.at("content").is_string(), "content must be a string", "content");
  TokenizeSpec t;
  t.content = body.at("content").get<std::string>();
  field(body, "add_special", t.add_special);
  field(body, "parse_special", t.parse_special);
  field(body, "with_pieces", t.with_pieces);
  return t;
}

std::vector<std::int64_t> parse_detokenize(std::string_view text) {
  const json body = object_body(text, {"tokens"});
  require(body.contains("tokens") && body.at("tokens").is_array(), "tokens must be an array of token ids", "tokens");
  std::vector<std::int64_t> ids;
  for (const json& t : body.at("tokens")) {
    require(t.is_number_integer() && t.get<std::int64_t>() >= 0, "tokens must be an array of token ids", "tokens");
    ids.push_back(t.get<std::int64_t>());
  }
  return ids;
}

std::string not_served(const std::string& asked, const std::string& served) {
  return fmt::format("model '{}' is not served here (it serves '{}')", asked, served);
}

RequestSpec parse_request(std::string_view text, bool chat, const RequestDefaults& d) {
  const json body = parse_object(text);
  static const std::vector<std::string> common = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                                                  "stream", "stream_options", "logprobs", "n", "user",
                                                  "presence_penalty", "frequency_penalty", "witcert"};
  static const std::vector<std::string> chat_only = {"messages", "top_logprobs", "max_completion_tokens"};
  static const std::vector<std::string> completion_only = {"prompt", "echo"};
  for (const auto& item : body.items()) {
    const std::string& key = item.key();
    const auto known = [&](const std::vector<std::string>& v) { return std::find(v.begin(), v.end(), key) != v.end(); };
    if (!known(common) && !known(chat ? chat_only : completion_only))
      throw ApiError(400, fmt::format("'{}' is not supported by this server", key), key, "unsupported_parameter");
  }
  RequestSpec s;
  s.chat = chat;
  engine::BatchRequest& r = s.req;

  std::string model_name;
  field(body, "model", model_name);
  require(model_name.empty() || model_name == d.model_name, not_served(model_name, d.model_name), "model",
          "model_not_found");
  int n = 1;
  field(body, "n", n);
  require(n == 1, "n > 1 is not supported: one choice per request", "n", "unsupported_parameter");
  for (const char* penalty : {"presence_penalty", "frequency_penalty"}) {
    double v = 0.0;
    field(body, penalty, v);
    require(v == 0.0, fmt::format("'{}' is not supported (only 0)", penalty), penalty, "unsupported_parameter");
  }
  bool echo = false;
  if (!chat) field(body, "echo", echo);
  require(!echo, "echo is not supported", "echo", "unsupported_parameter");
  std::string user;
  field(body, "user", user);

  if (chat) {
    require(body.contains("messages"), "'messages' is required", "messages", "missing_parameter");
    try {
      s.messages = chat_messages(body.at("messages"));
    } catch (const std::invalid_argument& e) {
      throw ApiError(400, e.what(), "messages");
    }
  } else {
    require(body.contains("prompt"), "'prompt' is required", "prompt", "missing_parameter");
    // A string, a list of one string, token ids, or a list of one list of token ids.
    json p = body.at("prompt");
    const char* shape = "'prompt' must be a string, token ids, or a list of one of them";
    if (p.is_array() && !p.empty() && (p.front().is_string() || p.front().is_array())) {
      require(p.size() == 1, "one prompt per request: a list of several prompts is not supported", "prompt",
              "unsupported_parameter");
      p = json(p.front());
    }
    if (p.is_string()) {
      s.prompt = p.get<std::string>();
    } else {
      require(p.is_array(), shape, "prompt", "invalid_type");
      for (const json& id : p) {
        require(id.is_number_integer() && id.get<std::int64_t>() >= 0 && id.get<std::int64_t>() <= std::numeric_limits<std::int32_t>::max(), shape,
                "prompt", "invalid_type");
        s.prompt_ids.push_back(static_cast<std::int32_t>(id.get<std::int64_t>()));
      }
      s.prompt_is_ids = true;
    }
  }

  r.max_tokens = d.max_tokens;
  field(body, "max_tokens", r.max_tokens);
  if (chat) field(body, "max_completion_tokens", r.max_tokens);
  const auto given = [&](const char* key) { return body.contains(key) && !body.at(key).is_null(); };
  s.max_tokens_given = given("max_tokens") || (chat && given("max_completion_tokens"));
  require(r.max_tokens >= 1 && r.max_tokens <= 1000000, "'max_tokens' must be in [1, 1000000]", "max_tokens");
  field(body, "temperature", r.sampler.temperature);
  require(std::isfinite(r.sampler.temperature) && r.sampler.temperature >= 0 && r.sampler.temperature <= 2,
          "'temperature' must be in [0, 2]", "temperature");
  field(body, "top_p", r.sampler.top_p);
  require(r.sampler.top_p > 0 && r.sampler.top_p <= 1, "'top_p' must be in (0, 1]", "top_p");
  // top_k as vLLM and llama-server take it: k ≥ 1 keeps the k most likely tokens; 0 or -1 keeps all.
  field(body, "top_k", r.sampler.top_k);
  require(r.sampler.top_k >= -1, "'top_k' must be -1, 0 (every token) or at least 1", "top_k");
  r.sampler.top_k = std::max(r.sampler.top_k, 0);
  field(body, "seed", r.sampler.seed);
  if (body.contains("stop") && !body.at("stop").is_null()) {
    const json& st = body.at("stop");
    if (st.is_string()) s.stop.push_back(st.get<std::string>());
    else if (st.is_array())
      for (const json& x : st) {
        require(x.is_string(), "'stop' must be a string or an array of strings", "stop", "invalid_type");
        s.stop.push_back(x.get<std::string>());
      }
    else throw ApiError(400, "'stop' must be a string or an array of strings", "stop", "invalid_type");
    require(s.stop.size() <= 4, "'stop' holds at most 4 strings", "stop");
    for (const std::string& x : s.stop) require(!x.empty(), "a stop string must not be empty", "stop");
  }
  field(body, "stream", s.stream);
  if (body.contains("stream_options") && !body.at("stream_options").is_null()) {
    const json& so = body.at("stream_options");
    require(so.is_object(), "'stream_options' must be an object", "stream_options", "invalid_type");
    for (const auto& [key, value] : so.items())
      require(key == "include_usage", fmt::format("'stream_options.{}' is not supported", key), "stream_options",
              "unsupported_parameter");
    field(so, "include_usage", s.include_usage, "stream_options.include_usage");
  }
  if (chat) {
    field(body, "logprobs", s.logprobs);
    int top = 0;
    field(body, "top_logprobs", top);
    require(top >= 0 && top <= 20, "'top_logprobs' must be in [0, 20]", "top_logprobs");
    require(top == 0 || s.logprobs, "'top_logprobs' needs 'logprobs': true", "top_logprobs");
    s.top_logprobs = s.logprobs ? top : -1;
  } else if (body.contains("logprobs") && !body.at("logprobs").is_null()) {
    int top = 0;
    field(body, "logprobs", top);
    require(top >= 0 && top <= 5, "'logprobs' must be in [0, 5]", "logprobs");
    s.logprobs = true;
    s.top_logprobs = top;
  }

  json w = json::object();
  if (body.contains("witcert") && !body.at("witcert").is_null()) {
    w = body.at("witcert");
    require(w.is_object(), "'witcert' must be an object", "witcert", "invalid_type");
    static const std::vector<std::string_view> keys = [] {
      std::vector<std::string_view> k(std::begin(engine::RequestPolicy::kKeys), std::end(engine::RequestPolicy::kKeys));
      k.push_back("detail");
      k.push_back("meter_every");
      return k;
    }();
    for (const auto& [key, value] : w.items())
      require(std::find(keys.begin(), keys.end(), key) != keys.end(),
              fmt::format("'witcert.{}' is not a setting ({})", key, fmt::join(keys, ", ")), "witcert." + key,
              "unsupported_parameter");
    field(w, "detail", s.detail, "witcert.detail");
    field(w, "meter_every", s.meter_every, "witcert.meter_every");
    require(s.meter_every >= 0, "'witcert.meter_every' must not be negative", "witcert.meter_every");
    w.erase("detail");
    w.erase("meter_every");
  }
  try {
    r.set_policy(engine::RequestPolicy::from_json(w, d.cache, d.coverage_tau, d.coverage_tau_v));
  } catch (const std::invalid_argument& e) {
    throw ApiError(400, std::string("witcert: ") + e.what(), "witcert", "invalid_value");
  }
  return s;
}

}  // namespace witcert::apps
