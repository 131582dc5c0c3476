// libFuzzer target for `witcert serve`'s request parsing: every body, as a completion and as a
// chat request, over a plain, a certified and a gated pool, must either give a request inside the
// documented ranges or raise a 400 ApiError whose body is valid JSON. Any other exception, a crash
// or a sanitizer report is a bug.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "apps/serve/request.h"

namespace {

using witcert::apps::ApiError;
using witcert::apps::RequestDefaults;
using witcert::apps::RequestSpec;

const std::vector<RequestDefaults>& pools() {
  static const std::vector<RequestDefaults> p = [] {
    std::vector<RequestDefaults> v;
    for (const char* cache : {R"({})", R"({"kv": "dither-int8"})", R"({"kv": "q8_0", "kv_v": "q4_0", "tau_k": 0.2})"}) {
      RequestDefaults d;
      d.model_name = "smollm2";
      d.cache = witcert::engine::CacheOptions::from_json(nlohmann::json::parse(cache));
      v.push_back(d);
    }
    return v;
  }();
  return p;
}

void check(bool ok) {
  if (!ok) std::abort();
}

// What an accepted request promises the engine.
void check_accepted(const RequestSpec& s, bool chat) {
  const auto& r = s.req;
  check(s.chat == chat);
  check(chat ? !s.messages.empty() : s.messages.empty());
  check(r.prompt.empty());
  check(r.max_tokens >= 1 && r.max_tokens <= 1000000);
  check(std::isfinite(r.sampler.temperature) && r.sampler.temperature >= 0 && r.sampler.temperature <= 2);
  check(r.sampler.top_p > 0 && r.sampler.top_p <= 1);
  check(s.stop.size() <= 4);
  for (const auto& x : s.stop) check(!x.empty());
  check(s.top_logprobs >= -1 && s.top_logprobs <= 20);
  check(s.logprobs == (s.top_logprobs >= 0));
  check(r.coverage_tau > 0 && r.coverage_tau <= 1);
  check(std::isfinite(r.coverage_tau_v) && r.coverage_tau_v > 0);
  r.cache.validate();  // throws on a policy the pool cannot run: uncaught, so reported
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  for (const RequestDefaults& d : pools())
    for (bool chat : {false, true}) {
      try {
        check_accepted(witcert::apps::parse_request(body, chat, d), chat);
      } catch (const ApiError& e) {
        check(e.status == 400);
        const nlohmann::json back = nlohmann::json::parse(witcert::apps::error_text(e));
        check(back.at("error").at("message").is_string() && !back.at("error").at("message").get<std::string>().empty());
      }
    }
  return 0;
}
