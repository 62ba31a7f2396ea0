#include "server/http_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <malloc.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <boost/asio/buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/status.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <optional>
#include <thread>

#include "core/logging.h"

namespace nucleus::server {

namespace http = boost::beast::http;
using Clock = std::chrono::steady_clock;

namespace {

// poll() waits in slices of at most this, so stop() is seen within it.
constexpr int kPollSliceMs = 200;
// After a request body this large, free memory is returned to the system.
constexpr size_t kTrimAfterBytes = size_t{1} << 20;

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) { return std::tolower(x) == std::tolower(y); });
}

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

int ms_until(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(ms, 0, kPollSliceMs));
}

std::string reason_phrase(int status) {
  const auto r = http::obsolete_reason(http::int_to_status(static_cast<unsigned>(status)));
  return r.empty() ? std::string("Unknown") : std::string(r.data(), r.size());
}

// An OpenAI-style error body for the transport's own refusals.
std::string error_body(std::string_view message) {
  std::string escaped;
  for (char c : message) {
    if (c == '"' || c == '\\') escaped += '\\';
    escaped += c;
  }
  return fmt::format(R"({{"error":{{"message":"{}","type":"invalid_request_error","param":null,"code":null}}}})",
                     escaped);
}

// Undoes Content-Encoding gzip / x-gzip / deflate into `out`, at most `limit`
// bytes. Returns 0 (done), 413 (inflates past the limit) or 400 (corrupt).
int inflate_body(std::string_view in, size_t limit, std::string& out) {
  z_stream z{};
  if (inflateInit2(&z, 15 + 32) != Z_OK) return 400;  // 15 + 32: zlib or gzip header, detected
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  z.avail_in = static_cast<uInt>(in.size());
  char chunk[1 << 16];
  int rc = Z_OK;
  int result = 0;
  while (rc != Z_STREAM_END) {
    z.next_out = reinterpret_cast<Bytef*>(chunk);
    z.avail_out = sizeof chunk;
    rc = inflate(&z, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) {
      result = 400;
      break;
    }
    const size_t produced = sizeof chunk - z.avail_out;
    if (out.size() + produced > limit) {
      result = 413;
      break;
    }
    out.append(chunk, produced);
    if (rc == Z_OK && produced == 0 && z.avail_in == 0) {  // truncated stream
      result = 400;
      break;
    }
  }
  inflateEnd(&z);
  return result;
}

}  // namespace

std::string HttpRequest::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (iequals(k, name)) return v;
  return {};
}

// ---- HttpResponder -------------------------------------------------------------

bool HttpResponder::write_all(std::string_view data) {
  if (failed_) return false;
  auto deadline = after(limits_.write_timeout_s);
  while (!data.empty()) {
    ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      deadline = after(limits_.write_timeout_s);  // progress restarts the clock
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && Clock::now() < deadline) {
      pollfd p{fd_, POLLOUT, 0};
      ::poll(&p, 1, ms_until(deadline));
      continue;
    }
    failed_ = true;
    return false;
  }
  return true;
}

bool HttpResponder::write_head(int status, std::string_view content_type, const HttpHeaders& extra,
                               std::string_view framing) {
  status_ = status;
  std::string head = fmt::format("HTTP/1.1 {} {}\r\n", status, reason_phrase(status));
  if (!content_type.empty()) head += fmt::format("Content-Type: {}\r\n", content_type);
  for (const auto& [k, v] : extra) head += fmt::format("{}: {}\r\n", k, v);
  head += framing;
  head += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  return write_all(head);
}

bool HttpResponder::send(int status, std::string_view content_type, std::string_view body, const HttpHeaders& extra) {
  if (responded()) return false;
  if (!write_head(status, content_type, extra, fmt::format("Content-Length: {}\r\n", body.size()))) return false;
  return write_all(body);
}

bool HttpResponder::start_chunked(int status, std::string_view content_type, const HttpHeaders& extra) {
  if (responded()) return false;
  chunked_ = true;
  return write_head(status, content_type, extra, "Transfer-Encoding: chunked\r\n");
}

bool HttpResponder::write_chunk(std::string_view data) {
  if (!chunked_ || finished_) return false;
  if (data.empty()) return !failed_;  // an empty chunk would end the body
  return write_all(fmt::format("{:x}\r\n", data.size())) && write_all(data) && write_all("\r\n");
}

bool HttpResponder::finish_chunked() {
  if (!chunked_ || finished_) return false;
  finished_ = true;
  return write_all("0\r\n\r\n");
}

bool HttpResponder::client_gone() const {
  if (failed_) return true;
  pollfd p{fd_, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) < 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

// ---- Connection ---------------------------------------------------------------

namespace {

enum class Fill { kOk, kClosed, kTimeout, kStopped };

// One connection's read side: the bytes received and not yet parsed.
class Connection {
 public:
  Connection(int fd, const HttpLimits& limits, const std::atomic<bool>& stopping)
      : fd_(fd), limits_(limits), stopping_(stopping) {}

  // Reads the next request into `req`. Returns 0 with a request, -1 when the
  // connection ended (closed, idle past the keep-alive timeout, stopping),
  // or the status to answer before closing (400, 408, 413, 415, 431).
  int read_request(HttpRequest& req, bool& keep_alive, std::string& why) {
    if (buf_.empty() && fill(after(limits_.keep_alive_timeout_s), /*idle=*/true) != Fill::kOk) return -1;
    const auto deadline = after(limits_.request_timeout_s);
    // Empty lines before a request line are skipped (RFC 9112, 2.2).
    while (!buf_.empty() && (buf_[0] == '\r' || buf_[0] == '\n')) {
      buf_.erase(0, 1);
      if (buf_.empty() && fill(deadline, /*idle=*/false) != Fill::kOk) return -1;
    }
    http::request_parser<http::string_body> parser;
    parser.header_limit(static_cast<std::uint32_t>(std::min<size_t>(limits_.max_header_bytes, UINT32_MAX)));
    parser.body_limit(limits_.max_body_bytes);
    parser.eager(false);  // stop after the header: its size is what put() consumed until then
    size_t header_bytes = 0;
    bool header_seen = false;
    // After the header the parser consumes chunk data as it comes, but a
    // chunk-size line, and the last chunk with its trailers, only whole; the
    // trailers count against neither of its limits. So the body is fed in
    // slices, and an element that is still incomplete in more than
    // max_header_bytes of buffered input is refused (1.2 GB of trailers on one
    // connection were read and kept before).
    constexpr size_t kBodySlice = size_t{1} << 16;
    for (;;) {
      boost::system::error_code ec;
      size_t used = 0;
      if (!buf_.empty()) {
        size_t n = header_seen ? std::min(buf_.size(), kBodySlice) : buf_.size();
        for (;;) {
          try {
            used = parser.put(boost::asio::buffer(buf_.data(), n), ec);
          } catch (const std::exception& e) {  // a field past the container's limit (64 KiB) throws
            why = std::string("a header or trailer field is too large (") + e.what() + ")";
            return 431;
          }
          if (used > 0 || ec != http::error::need_more || n == buf_.size()) break;
          n = buf_.size();  // one element longer than the slice: the whole buffer
        }
        buf_.erase(0, used);
        if (!header_seen) header_bytes += used;
        if (header_seen && used == 0 && ec == http::error::need_more && buf_.size() > limits_.max_header_bytes) {
          why = fmt::format("a chunk-size line or the chunked trailers take more than {} bytes",
                            limits_.max_header_bytes);
          return 431;
        }
      }
      if (ec && ec != http::error::need_more) {
        why = ec.message();
        if (ec == http::error::header_limit) return 431;
        if (ec == http::error::body_limit) return 413;
        return 400;
      }
      if (parser.is_header_done() && !header_seen) {
        header_seen = true;
        parser.eager(true);
        if (header_bytes > limits_.max_header_bytes) {
          why = fmt::format("the request line and headers take {} bytes, more than {}", header_bytes,
                            limits_.max_header_bytes);
          return 431;
        }
        const std::string te(parser.get()[http::field::transfer_encoding]);
        if (!te.empty() && !iequals(te, "chunked")) {
          why = "Transfer-Encoding '" + te + "' is not supported (only chunked)";
          return 501;
        }
        if (iequals(std::string(parser.get()[http::field::expect]), "100-continue") && !parser.is_done() &&
            !send_raw("HTTP/1.1 100 Continue\r\n\r\n"))
          return -1;
      }
      if (parser.is_done()) break;
      if (used > 0 && !buf_.empty() && !ec) continue;  // more to parse from what is here
      const Fill f = fill(deadline, /*idle=*/false);
      if (f == Fill::kTimeout) {
        why = fmt::format("the request did not arrive within {} s", limits_.request_timeout_s);
        return 408;
      }
      if (f != Fill::kOk) return -1;
    }
    auto& msg = parser.get();
    req.method = std::string(msg.method_string());
    std::string target(msg.target());
    req.path = target.substr(0, target.find('?'));
    req.headers.clear();
    for (const auto& f : msg) req.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    keep_alive = msg.keep_alive();
    const std::string encoding(msg[http::field::content_encoding]);
    if (encoding.empty() || iequals(encoding, "identity")) {
      req.body = std::move(msg.body());
    } else if (iequals(encoding, "gzip") || iequals(encoding, "x-gzip") || iequals(encoding, "deflate")) {
      req.body.clear();
      if (int rc = inflate_body(msg.body(), limits_.max_body_bytes, req.body); rc != 0) {
        why = rc == 413 ? fmt::format("the {} body inflates past {} bytes", encoding, limits_.max_body_bytes)
                        : fmt::format("the {} body is corrupt", encoding);
        return rc;
      }
    } else {
      why = "Content-Encoding '" + encoding + "' is not supported (gzip, deflate or identity)";
      return 415;
    }
    return 0;
  }

  // Writes bytes outside any response (the interim 100 Continue).
  bool send_raw(std::string_view data) {
    const auto deadline = after(limits_.write_timeout_s);
    while (!data.empty()) {
      ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n > 0) {
        data.remove_prefix(static_cast<size_t>(n));
      } else if (n < 0 && (errno == EINTR || ((errno == EAGAIN || errno == EWOULDBLOCK) && Clock::now() < deadline))) {
        pollfd p{fd_, POLLOUT, 0};
        ::poll(&p, 1, ms_until(deadline));
      } else {
        return false;
      }
    }
    return true;
  }

 private:
  // Appends what the socket has to buf_, waiting until `deadline`. `idle`:
  // between requests, when stop() may end the wait.
  Fill fill(Clock::time_point deadline, bool idle) {
    char tmp[1 << 16];
    for (;;) {
      ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
      if (n > 0) {
        buf_.append(tmp, static_cast<size_t>(n));
        return Fill::kOk;
      }
      if (n == 0) return Fill::kClosed;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return Fill::kClosed;
      if (Clock::now() >= deadline) return Fill::kTimeout;
      if (idle && stopping_.load()) return Fill::kStopped;
      pollfd p{fd_, POLLIN, 0};
      ::poll(&p, 1, ms_until(deadline));
    }
  }

  int fd_;
  const HttpLimits& limits_;
  const std::atomic<bool>& stopping_;
  std::string buf_;  // received, not yet parsed: the rest of a pipelined batch
};

}  // namespace

// ---- HttpTransport ------------------------------------------------------------

HttpTransport::HttpTransport(HttpLimits limits, HttpHandler handler)
    : limits_(limits), handler_(std::move(handler)) {}

HttpTransport::~HttpTransport() {
  stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

Status HttpTransport::bind(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0)
    return invalid_argument("--host " + host + ": " + gai_strerror(rc));
  std::string err = "no address";
  for (addrinfo* a = found; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;
    // SO_REUSEADDR only: SO_REUSEPORT would let a second server share the port.
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 4096) == 0) {
      listen_fd_ = fd;
      break;
    }
    err = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (listen_fd_ < 0)
    return invalid_argument("cannot listen on " + host + ":" + std::to_string(port) + " (" + err +
                            "; pick --host / --port)");
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return ok_status();
}

bool HttpTransport::serve() {
  if (listen_fd_ < 0) return false;
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, kPollSliceMs) <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        NUCLEUS_LOG_WARN("accept: {}; retrying", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      NUCLEUS_LOG_ERROR("accept: {}", std::strerror(errno));
      return stopping_.load();
    }
    int yes = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);  // stream tokens as they come
    if (num_connections_.load() >= limits_.max_connections) {
      refuse_connection(fd);
      continue;
    }
    ++num_connections_;
    try {
      std::thread([this, fd] { serve_connection(fd); }).detach();
    } catch (const std::system_error& e) {  // no thread to be had: refuse, as over the limit
      --num_connections_;
      refuse_connection(fd);
    }
  }
  return true;
}

void HttpTransport::refuse_connection(int fd) {
  const std::string body = error_body(fmt::format("too many connections (--max-connections {})", limits_.max_connections));
  const std::string msg = fmt::format(
      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
      "Retry-After: 1\r\nConnection: close\r\n\r\n{}",
      body.size(), body);
  (void)!::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);  // best effort, never blocks
  ::close(fd);
}

void HttpTransport::serve_connection(int fd) {
  Connection conn(fd, limits_, stopping_);
  for (;;) {
    HttpRequest req;
    bool keep_alive = false;
    std::string why;
    const int rc = conn.read_request(req, keep_alive, why);
    if (rc < 0) break;
    if (rc > 0) {
      HttpResponder res(fd, limits_, /*keep_alive=*/false);
      res.send(rc, "application/json", error_body(why));
      NUCLEUS_LOG_DEBUG("connection refused a request: {} {}", rc, why);
      break;
    }
    HttpResponder res(fd, limits_, keep_alive && !stopping_.load());
    try {
      handler_(req, res);
    } catch (const std::exception& e) {
      NUCLEUS_LOG_ERROR("{} {}: {}", req.method, req.path, e.what());
      if (!res.responded()) res.send(500, "application/json", error_body(std::string("Internal error: ") + e.what()));
    }
    // A handler that answered nothing gave up on a client that went away:
    // the connection just closes.
    if (!res.responded() && !res.client_gone())
      res.send(500, "application/json", error_body("the handler sent no response"));
    if (req.body.capacity() >= kTrimAfterBytes) {
      req = HttpRequest{};
      ::malloc_trim(0);  // give a large request's memory back to the system, not just to malloc
    }
    if (!res.responded() || !res.reusable()) break;
  }
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
  std::lock_guard<std::mutex> lock(mu_);
  if (--num_connections_ == 0) all_closed_.notify_all();
}

void HttpTransport::stop() {
  stopping_.store(true);
  std::unique_lock<std::mutex> lock(mu_);
  all_closed_.wait(lock, [&] { return num_connections_.load() == 0; });
}

}  // namespace nucleus::server
