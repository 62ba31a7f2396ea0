// HttpTransport: HTTP/1.1 over TCP for the OpenAI server, with the limits a
// server on a shared network needs.
//
// One thread per connection, at most HttpLimits::max_connections of them (a
// connection beyond is answered 503 and closed at once). Requests are parsed
// by Boost.Beast's HTTP/1.1 parser from a buffer that lives as long as the
// connection, so keep-alive and pipelined requests are answered in order.
// Every read and write runs against a deadline (poll() on a non-blocking
// socket), so a slow or silent client (slowloris) costs one connection for
// at most request_timeout_s, never a thread forever:
//   - between requests, a connection may sit idle keep_alive_timeout_s;
//   - a request's header and body must arrive within request_timeout_s of
//     its first byte (408 otherwise);
//   - a response write that makes no progress for write_timeout_s drops the
//     connection.
// Bodies are limited to max_body_bytes whatever their framing (Content-Length,
// chunked) and after Content-Encoding gzip/deflate is undone (413); headers
// to max_header_bytes (431); other encodings are refused (415); malformed
// requests get 400 and the connection is closed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace nucleus::server {

// Per-connection limits; each is a `nucleus serve` flag (docs/server.md).
struct HttpLimits {
  size_t max_body_bytes = size_t{64} << 20;   // request body after decompression (else 413)
  size_t max_header_bytes = size_t{64} << 10;  // request line and headers (else 431)
  double request_timeout_s = 30.0;    // from a request's first byte to its last (else 408)
  double keep_alive_timeout_s = 5.0;  // idle time between requests before the connection is closed
  double write_timeout_s = 30.0;      // a response write making no progress this long drops the connection
  int max_connections = 256;          // open connections (streams and idle keep-alive ones included)
};

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// One request as the handler sees it.
struct HttpRequest {
  std::string method;  // "GET", "POST", ... as sent
  std::string path;    // the target without its query string
  HttpHeaders headers;
  std::string body;  // Content-Encoding undone
  // The first header named `name` (case-insensitive), or "".
  std::string header(std::string_view name) const;
};

// Writes the response to one request: either send() once, or
// start_chunked(), write_chunk()..., finish_chunked(). Every call returns
// false once the connection has failed (the client went away, or stalled
// past write_timeout_s); later calls then do nothing.
class HttpResponder {
 public:
  HttpResponder(int fd, const HttpLimits& limits, bool keep_alive) : fd_(fd), limits_(limits), keep_alive_(keep_alive) {}
  bool send(int status, std::string_view content_type, std::string_view body, const HttpHeaders& extra = {});
  bool start_chunked(int status, std::string_view content_type, const HttpHeaders& extra = {});
  bool write_chunk(std::string_view data);
  bool finish_chunked();
  // Non-blocking: whether the client closed its side of the connection (or
  // it failed). A client that half-closes after its request counts as gone.
  bool client_gone() const;
  // The status sent (0: none yet).
  int status() const { return status_; }
  bool responded() const { return status_ != 0; }
  // Whether the connection can serve another request after this one.
  bool reusable() const { return keep_alive_ && !failed_ && (!chunked_ || finished_); }

 private:
  bool write_head(int status, std::string_view content_type, const HttpHeaders& extra, std::string_view framing);
  bool write_all(std::string_view data);

  int fd_;
  const HttpLimits& limits_;
  bool keep_alive_;
  int status_ = 0;
  bool chunked_ = false, finished_ = false, failed_ = false;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponder&)>;

class HttpTransport {
 public:
  // `handler` runs on the connection's thread; it may block (streams do).
  // An exception it throws becomes a 500 (or closes a started response).
  HttpTransport(HttpLimits limits, HttpHandler handler);
  ~HttpTransport();  // stop()
  HttpTransport(const HttpTransport&) = delete;
  HttpTransport& operator=(const HttpTransport&) = delete;

  // Binds and listens. `port` 0: any free port. Errors: the address cannot
  // be bound (in use, not local).
  Status bind(const std::string& host, int port);
  int port() const { return port_; }

  // Accepts connections until stop(); returns true then, false when the
  // listening socket failed.
  bool serve();
  // Stops accepting, closes connections between requests, and waits until
  // every handler has returned. Idempotent; callable from any thread.
  void stop();

  // Open connections now.
  int num_connections() const { return num_connections_.load(); }

 private:
  void serve_connection(int fd);
  void refuse_connection(int fd);

  HttpLimits limits_;
  HttpHandler handler_;
  int listen_fd_ = -1;
  int port_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int> num_connections_{0};
  std::mutex mu_;
  std::condition_variable all_closed_;
};

}  // namespace nucleus::server
