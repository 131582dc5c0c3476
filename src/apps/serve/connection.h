// The server's connections, where cpp-httplib 0.11 lacks what a server on a network needs: a
// deadline and a size bound for a request's headers and for its body (a client sending a byte a
// second is cut off, and so is one sending headers without end),
// a limit on open connections apart from the work they do (one past it gets 503 at once), one
// read buffer per connection (a pipelined request is answered, not dropped), a connection closed
// after every error response (no unread body is taken for the next request), and a way for a
// handler to ask whether its client is still there.
#pragma once

#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>

namespace witcert::apps {

struct ConnectionLimits {
  int max_connections = 256;                       // open at once; one more is answered 503 and closed
  std::chrono::milliseconds header_timeout{10000};  // from a request's first byte to its last header
  std::chrono::milliseconds body_timeout{30000};    // from the last header to the body's last byte
  std::chrono::milliseconds idle_timeout{5000};     // between two requests of a kept-alive connection
  std::chrono::milliseconds write_timeout{30000};   // for a client to take one write
  std::size_t max_header_bytes = 64 << 10;           // a request's line and headers
  std::size_t max_body_bytes = (1 << 20) + (64 << 10);  // a body on the wire, with its chunked framing
};

// An httplib::Server whose connections run under ConnectionLimits, each on a thread of its own.
class GuardedServer : public httplib::Server {
 public:
  explicit GuardedServer(const ConnectionLimits& limits);

  // Binds host:port (0: any free port) with an accept queue of SOMAXCONN instead of httplib's 5,
  // so that a burst of connections is accepted rather than left waiting for SYN retransmits.
  // The bound port, or -1.
  int bind(const std::string& host, int port);

  // On a handler's thread: true once the client of the request being handled has closed its side
  // or reset the connection (a client that half-closes after sending counts as gone).
  static bool client_gone();

 private:
  bool process_and_close_socket(socket_t sock) override;

  // Thread per connection up to the limit; past it the task runs on the accept thread, which then
  // answers 503 and closes (httplib's queue would hold the socket without a word).
  class Connections : public httplib::TaskQueue {
   public:
    explicit Connections(GuardedServer& server) : server_(server) {}
    void enqueue(std::function<void()> fn) override;
    void shutdown() override;  // waits for every connection to end

   private:
    GuardedServer& server_;
  };

  ConnectionLimits limits_;
  std::mutex mu_;
  std::condition_variable ended_;  // a connection ended
  int open_ = 0;                   // connections open now
};

}  // namespace witcert::apps
