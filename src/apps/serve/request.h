// A request's body, validated: the OpenAI-style fields `witcert serve` takes, and the meter policy
// shared by `witcert batch` and `witcert serve`. Nothing here needs the model, so the fuzz target
// (fuzz/request_fuzz.cc) drives it on arbitrary bytes.
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "engine/batch.h"
#include "engine/options.h"
#include "model/tokenizer.h"

namespace witcert::apps {

// An OpenAI-style error: HTTP status, message, type, the offending parameter and a code.
struct ApiError : std::runtime_error {
  int status;
  std::string type, param, code;
  ApiError(int s, const std::string& message, std::string p = "", std::string c = "", std::string t = "");
};

// JSON as WitCert writes it for a client or a results file: compact, with bytes that are not UTF-8
// (a token's piece of a character, a quoted bad input) replaced by U+FFFD instead of a throw.
std::string json_text(const nlohmann::json& j);

// The error's OpenAI-style body: {"error": {message, type, param, code}}.
nlohmann::json error_json(const ApiError& e);
// That body as the server sends it (json_text: the parser's "last read" of a binary body quotes
// bytes that are not UTF-8).
std::string error_text(const ApiError& e);

// What a request falls back to where its body is silent.
struct RequestDefaults {
  std::string model_name;       // the one model served; a body's "model" must be it or absent
  int max_tokens = 256;
  engine::CacheOptions cache;   // the pool's formats and default policy
  double coverage_tau = 0.2;
  double coverage_tau_v = 0.05;
};

// A request as its body asked for it: everything but the prompt's tokens, which need the model.
struct RequestSpec {
  bool chat = false;
  std::string prompt;                        // /v1/completions
  std::vector<std::int32_t> prompt_ids;      // /v1/completions given token ids (taken as they are)
  bool prompt_is_ids = false;
  std::vector<model::ChatMessage> messages;  // /v1/chat/completions
  engine::BatchRequest req;                  // sampler, max_tokens, cache policy; req.prompt empty
  std::vector<std::string> stop;             // at most 4, none empty
  bool stream = false, detail = false, include_usage = true;
  bool max_tokens_given = false;  // the body set max_tokens (else the server's default, cut to the context)
  bool logprobs = false;
  int top_logprobs = -1;  // < 0: no logprobs
  int meter_every = 1;    // a stream's chunks carry the meter so far after every this many tokens (0: only the last)
};

// Validates a /v1/completions (chat false) or /v1/chat/completions body. Throws ApiError (400)
// naming the field for malformed JSON, unknown or unsupported fields, wrong types and values out
// of range; nothing else escapes.
RequestSpec parse_request(std::string_view body, bool chat, const RequestDefaults& d);
// The message for a request naming a model other than the one served.
std::string not_served(const std::string& asked, const std::string& served);

// The body of POST /tokenize, as llama-server takes it: the text, whether to add the model's bos,
// whether special-token text becomes its token (on by default, as llama-server), and whether each
// id comes with its piece. Throws ApiError 400 naming the field for anything else.
struct TokenizeSpec {
  std::string content;
  bool add_special = false, parse_special = true, with_pieces = false;
};
TokenizeSpec parse_tokenize(std::string_view body);
// The ids of a POST /detokenize body {"tokens": [...]}, each a non-negative integer (the server
// checks them against its vocabulary). Throws ApiError 400 naming the field.
std::vector<std::int64_t> parse_detokenize(std::string_view body);

// Chat messages from a JSON array of {role, content} (role system, user or assistant; content a
// string or an array of text parts, joined by newlines). Throws std::invalid_argument saying what
// is wrong.
std::vector<model::ChatMessage> chat_messages(const nlohmann::json& messages);


}  // namespace witcert::apps
