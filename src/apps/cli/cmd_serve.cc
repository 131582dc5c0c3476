// `witcert serve`: the OpenAI-compatible server (apps/serve/server.h) until SIGINT or SIGTERM,
// then a graceful stop: no new requests, running ones finish within the drain deadline.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <ostream>
#include <string>
#include <thread>

#include "apps/cli/commands.h"
#include "apps/serve/server.h"
#include "engine/model.h"

namespace witcert::apps {
namespace {

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }

// True for an address only this machine reaches (127.0.0.0/8, ::1, localhost).
bool loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

}  // namespace

int run_serve(const ServeArgs& args, std::ostream& err) {
  ServeOptions o;
  o.model_path = args.model.empty() ? engine::default_model_path() : args.model;
  o.cache = cache_options(args.cache, args.cache.kv, o.model_path);
  o.batch.max_seqs = args.max_seqs;
  o.batch.kv_memory = parse_bytes(args.kv_memory);
  o.batch.validate();
  o.coverage_tau = args.cache.coverage_tau;  // resolved by main (engine::coverage_tau)
  o.coverage_tau_v = args.cache.tau_v;
  o.threads = args.threads;
  o.host = args.host;
  o.port = args.port;
  o.api_key = args.api_key;
  o.max_tokens = args.max_tokens;
  o.max_waiting = args.max_waiting;
  o.max_body = static_cast<std::size_t>(parse_bytes(args.max_body));
  o.connections.max_connections =
      args.max_connections > 0 ? args.max_connections : std::max(256, args.max_seqs + args.max_waiting + 64);
  o.connections.header_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(args.header_timeout * 1000));
  o.connections.body_timeout = 3 * o.connections.header_timeout;
  if (o.api_key.empty() && !loopback(o.host))
    err << fmt::format(
               "witcert serve: WARNING: listening on {} without --api-key: anyone who can reach this address can "
               "run requests on this machine\n",
               o.host)
        << std::flush;

  Server server(o);
  const int port = server.start();
  err << fmt::format("witcert serve: listening on http://{}:{} (loading {})\n", o.host, port, o.model_path) << std::flush;
  if (!server.wait_ready()) {
    err << "witcert: error: " << server.load_error() << "\n";
    server.shutdown(std::chrono::milliseconds(0));
    return 2;
  }
  std::string kv = o.cache.format_name(formats::KvSide::key);
  if (o.cache.format_name(formats::KvSide::value) != kv) kv.append("/").append(o.cache.format_name(formats::KvSide::value));
  err << fmt::format("witcert serve: ready: KV {}, pool {}, up to {} sequences{}\n", kv, args.kv_memory, o.batch.max_seqs,
                     o.api_key.empty() ? "" : ", API key required on /v1")
      << std::flush;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  while (g_signal.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  err << fmt::format("witcert serve: signal {}: draining for up to {} s\n", g_signal.load(), args.drain_seconds)
      << std::flush;
  server.shutdown(std::chrono::milliseconds(static_cast<std::int64_t>(args.drain_seconds * 1000)));
  err << "witcert serve: stopped\n";
  return 0;
}

}  // namespace witcert::apps
