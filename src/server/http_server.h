// The OpenAI-compatible HTTP server (cpp-httplib): routes, server-sent-event
// streaming, errors as OpenAI error bodies, and graceful shutdown.
//
//   POST /v1/completions       POST /v1/chat/completions
//   GET  /v1/models            GET  /health            GET /metrics
//
// Each connection is served by a thread of a pool (http_threads); a request
// thread blocks on its OutputQueue while the AsyncEngine loop generates.
// docs/server.md describes the fields, errors and metrics.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/chat_template.h"
#include "io/tokenizer.h"
#include "server/async_engine.h"
#include "server/metrics.h"
#include "server/protocol.h"

namespace httplib {
class Server;
struct Response;
}  // namespace httplib

namespace nucleus::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (see bound_port())
  // Accepted "model" values; names[0] is the one reported.
  std::vector<std::string> served_model_names;
  std::string model_dir;   // reported as "root" in /v1/models
  int http_threads = 256;  // concurrent connections served (idle keep-alive ones included)
  // On shutdown: how long in-flight requests may run before they are aborted.
  double shutdown_timeout_s = 30.0;
};

class HttpServer {
 public:
  // `tokenizer`, `engine` and `chat_template` must outlive it. `chat_template`
  // may be null (chat is refused); so may `tokenizer` (--skip-tokenizer-init:
  // token-id prompts only, responses carry token_ids).
  HttpServer(ServerConfig config, AsyncEngine& engine, const Tokenizer* tokenizer, const ChatTemplate* chat_template);
  ~HttpServer();

  // Binds the listening socket. Errors: the address cannot be bound.
  Status bind();
  int bound_port() const { return port_; }

  // Serves until shutdown() has drained the requests; then returns true.
  // False: the listening socket failed.
  bool serve();

  // Graceful shutdown, from another thread (the signal handler's): refuse
  // new requests with 503, let in-flight ones finish for up to
  // shutdown_timeout_s (or until force() is called), abort the rest, stop
  // listening. Returns when serve() is about to return.
  void shutdown();
  // Cuts the grace period short (a second SIGINT/SIGTERM).
  void force();

 private:
  class ActiveGuard;
  struct StreamState;

  // Counts a generation request in flight; null when draining.
  std::shared_ptr<ActiveGuard> enter();
  void leave();

  void routes();
  void handle_generation(const std::string& body, bool chat, httplib::Response& res);
  std::string next_request_id(bool chat);

  ServerConfig config_;
  AsyncEngine& engine_;
  const Tokenizer* tokenizer_;
  ModelInfo model_info_;
  ServerMetrics metrics_;
  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;
  int64_t created_ = 0;  // unix seconds at start, for /v1/models

  std::mutex mu_;
  std::condition_variable cv_;
  int64_t active_ = 0;  // generation requests in flight
  bool draining_ = false;
  bool force_ = false;
  std::atomic<uint64_t> next_id_{0};
  uint64_t id_salt_ = 0;
};

}  // namespace nucleus::server
