#include "apps/serve/connection.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "apps/serve/request.h"

namespace witcert::apps {
namespace {

using Clock = std::chrono::steady_clock;

// poll() on one socket for up to `wait` (0: just look); the revents, 0 on timeout, -1 on error.
int poll_one(int sock, short events, std::chrono::milliseconds wait) {
  pollfd p{sock, events, 0};
  for (;;) {
    const int n = ::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(wait.count(), 0)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    return n == 0 ? 0 : p.revents;
  }
}

// True once the peer has closed its side or reset the connection. Bytes it sent and nobody read
// yet (a pipelined request) leave it open.
bool peer_closed(int sock) {
  const int r = poll_one(sock, POLLIN | POLLRDHUP, std::chrono::milliseconds(0));
  if (r < 0 || (r & (POLLERR | POLLHUP | POLLNVAL | POLLRDHUP))) return true;
  if (!(r & POLLIN)) return false;
  char c = 0;
  const ssize_t n = ::recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

void address_of(const sockaddr_storage& a, std::string& ip, int& port) {
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(a);
    ::inet_ntop(AF_INET, &v4.sin_addr, text, sizeof text);
    port = ntohs(v4.sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
    ::inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof text);
    port = ntohs(v6.sin6_port);
  }
  ip = text;
}

// One connection: its socket, a read buffer kept across its requests, and the deadline that the
// current read phase (headers, body) must meet.
class Connection final : public httplib::Stream {
 public:
  Connection(int sock, const ConnectionLimits& limits) : sock_(sock), limits_(limits) {}

  // Waits up to the idle timeout for the next request's first byte (already buffered counts);
  // false when the connection closed, stayed idle, or `stop` became true.
  template <class Stop>
  bool next_request(const Stop& stop) {
    const auto until = Clock::now() + limits_.idle_timeout;
    while (off_ == len_) {
      if (stop()) return false;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      if (left.count() <= 0) return false;
      const int r = poll_one(sock_, POLLIN, std::min(left, std::chrono::milliseconds(100)));
      if (r < 0) return false;
      if (r == 0) continue;
      begin(limits_.header_timeout, limits_.max_header_bytes);
      if (fill() <= 0) return false;
      close_after_ = false;
      return true;
    }
    // The next request is already buffered (pipelined).
    begin(limits_.header_timeout, limits_.max_header_bytes);
    close_after_ = false;
    return true;
  }
  void headers_read() { begin(limits_.body_timeout, limits_.max_body_bytes); }
  void close_after() { close_after_ = true; }
  bool must_close() const { return close_after_; }
  bool gone() const { return peer_closed(sock_); }

  bool is_readable() const override { return off_ < len_ || poll_one(sock_, POLLIN, left()) > 0; }
  bool is_writable() const override {
    return !gone() && poll_one(sock_, POLLOUT, limits_.write_timeout) > 0;
  }
  ssize_t read(char* ptr, std::size_t size) override {
    if (off_ == len_) {
      const ssize_t n = fill();
      if (n <= 0) return n;
    }
    const std::size_t n = std::min({size, len_ - off_, budget_});
    if (n == 0) return -1;  // the phase's bytes are spent: httplib answers 400 or drops the connection
    budget_ -= n;
    std::memcpy(ptr, buf_ + off_, n);
    off_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, std::size_t size) override {
    const int r = poll_one(sock_, POLLOUT, limits_.write_timeout);
    if (r <= 0 || (r & (POLLERR | POLLHUP | POLLNVAL))) return -1;
    for (;;) {
      const ssize_t n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      return n;
    }
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t n = sizeof a;
    if (::getpeername(sock_, reinterpret_cast<sockaddr*>(&a), &n) == 0) address_of(a, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t n = sizeof a;
    if (::getsockname(sock_, reinterpret_cast<sockaddr*>(&a), &n) == 0) address_of(a, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  // A read phase: its deadline from now and the bytes it may deliver.
  void begin(std::chrono::milliseconds timeout, std::size_t bytes) {
    deadline_ = Clock::now() + timeout;
    budget_ = bytes;
  }
  std::chrono::milliseconds left() const {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now()),
                    std::chrono::milliseconds(0));
  }
  // Refills the buffer within the phase's deadline: the bytes read, 0 at the peer's end, -1 on a
  // timeout or an error (httplib answers 400 or drops the connection).
  ssize_t fill() {
    off_ = len_ = 0;
    const std::chrono::milliseconds wait = left();
    if (wait.count() <= 0) return -1;
    const int r = poll_one(sock_, POLLIN, wait);
    if (r <= 0) return -1;
    for (;;) {
      const ssize_t n = ::recv(sock_, buf_, sizeof buf_, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) len_ = static_cast<std::size_t>(n);
      return n;
    }
  }

  int sock_;
  const ConnectionLimits& limits_;
  Clock::time_point deadline_ = Clock::now();
  std::size_t budget_ = 0;
  bool close_after_ = false;
  char buf_[4096];
  std::size_t off_ = 0, len_ = 0;
};

// The connection whose request this thread is handling (handlers run on their connection's thread).
thread_local Connection* t_connection = nullptr;
// Set by Connections::enqueue while it runs a task past the limit on the accept thread.
thread_local bool t_over_limit = false;

// The answer to a connection past the limit: sent without waiting, then the socket is closed.
void refuse(int sock) {
  static const std::string body =
      error_text(ApiError(503, "too many open connections; retry later", "", "too_many_connections"));
  const std::string text = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                           "Connection: close\r\nContent-Length: " +
                           std::to_string(body.size()) + "\r\n\r\n" + body;
  [[maybe_unused]] const ssize_t sent = ::send(sock, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

// Closes after the client has read the response: closing with unread bytes from the client (a
// refused request's body) would reset the connection and could discard the response on the way.
// What the client still sends is read and dropped for up to half a second.
void linger_and_close(int sock) {
  ::shutdown(sock, SHUT_WR);
  const auto until = Clock::now() + std::chrono::milliseconds(500);
  char sink[4096];
  for (std::size_t dropped = 0; dropped < (1u << 20);) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0 || poll_one(sock, POLLIN, left) <= 0) break;
    const ssize_t n = ::recv(sock, sink, sizeof sink, 0);
    if (n <= 0) break;
    dropped += static_cast<std::size_t>(n);
  }
  ::close(sock);
}

}  // namespace

GuardedServer::GuardedServer(const ConnectionLimits& limits) : limits_(limits) {
  new_task_queue = [this] { return new Connections(*this); };
  // The idle wait between requests is the connection's own (ConnectionLimits::idle_timeout).
  set_keep_alive_max_count(1000);
  set_keep_alive_timeout(std::max<time_t>(1, static_cast<time_t>(limits_.idle_timeout.count() / 1000)));
  // Every answer may be read by a page of any origin (the API key still guards the model routes).
  // An error response ends its connection: the request's body may be unread, and reading on would
  // take it for the next request.
  set_post_routing_handler([](const httplib::Request&, httplib::Response& res) {
    res.set_header("Access-Control-Allow-Origin", "*");
    if (res.status < 400) return;
    res.headers.erase("Keep-Alive");
    if (!res.has_header("Connection")) res.set_header("Connection", "close");
    if (t_connection) t_connection->close_after();
  });
}

int GuardedServer::bind(const std::string& host, int port) {
  const int bound = port == 0 ? bind_to_any_port(host) : (bind_to_port(host, port) ? port : -1);
  if (bound >= 0) ::listen(svr_sock_, SOMAXCONN);  // listen() again only lengthens the queue
  return bound;
}

bool GuardedServer::client_gone() { return t_connection != nullptr && t_connection->gone(); }

bool GuardedServer::process_and_close_socket(socket_t sock) {
  if (t_over_limit) {
    // On the accept thread: answered and closed at once, without lingering.
    refuse(sock);
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return false;
  }
  bool ok = false;
  Connection conn(sock, limits_);
  t_connection = &conn;
  std::size_t left = keep_alive_max_count_;
  while (left > 0 && conn.next_request([this] { return !is_running(); })) {
    bool closed = false;
    ok = process_request(conn, left == 1 || !is_running(), closed, [&](httplib::Request&) { conn.headers_read(); });
    // An error response may leave a body unread: the connection ends rather than parse it as a request.
    if (!ok || closed || conn.must_close()) break;
    --left;
  }
  t_connection = nullptr;
  linger_and_close(sock);
  return ok;
}

void GuardedServer::Connections::enqueue(std::function<void()> fn) {
  GuardedServer& s = server_;
  bool over = false;
  {
    std::lock_guard lock(s.mu_);
    over = s.open_ >= s.limits_.max_connections;
    if (!over) s.open_ += 1;
  }
  if (over) {
    t_over_limit = true;
    fn();
    t_over_limit = false;
    return;
  }
  std::thread([&s, fn = std::move(fn)] {
    fn();
    std::lock_guard lock(s.mu_);
    s.open_ -= 1;
    s.ended_.notify_all();
  }).detach();
}

void GuardedServer::Connections::shutdown() {
  std::unique_lock lock(server_.mu_);
  server_.ended_.wait(lock, [&] { return server_.open_ == 0; });
}

}  // namespace witcert::apps
