// The OpenAI-compatible HTTP server (cpp-httplib): routes, server-sent-event
// streaming, errors as OpenAI error bodies, and graceful shutdown.
//
//   POST /v1/completions       POST /v1/chat/completions
//   GET  /v1/models            GET  /health            GET /metrics
//
// HTTP/1.1 itself (connections, limits, timeouts, pipelining) is
// HttpTransport's; each connection's thread blocks on its request's
// OutputQueue while the AsyncEngine loop generates, checking now and then
// whether the client went away (then its requests are aborted and their KV
// blocks freed). docs/server.md describes the fields, errors and metrics.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "io/chat_template.h"
#include "io/tokenizer.h"
#include "runtime/structured_output.h"
#include "server/async_engine.h"
#include "server/http_transport.h"
#include "server/metrics.h"
#include "server/protocol.h"

namespace nucleus::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (see bound_port())
  // Accepted "model" values; names[0] is the one reported.
  std::vector<std::string> served_model_names;
  std::string model_dir;   // reported as "root" in /v1/models
  HttpLimits http;          // connections, timeouts, body and header sizes
  RequestLimits requests;   // JSON depth, choices, stop lists
  // Chat output parsing (docs/server.md, "Tool calls and reasoning"):
  // --tool-call-parser, --enable-auto-tool-choice, --reasoning-parser.
  std::optional<ToolCallFormat> tool_call_parser;
  bool enable_auto_tool_choice = false;
  bool reasoning_parser = false;
  // On shutdown: how long in-flight requests may run before they are aborted.
  double shutdown_timeout_s = 30.0;
  // Why the model's chat template could not be used (its parse error), when it
  // has one that does not parse: chat requests are refused with it.
  std::string chat_template_error;
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
  int bound_port() const { return transport_.port(); }

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

  // Counts a generation request in flight; null when draining.
  std::shared_ptr<ActiveGuard> enter();
  void leave();

  // Routes one request (404 / 405 for unknown routes and methods).
  void handle(const HttpRequest& req, HttpResponder& res);
  void handle_generation(const std::string& body, bool chat, HttpResponder& res);
  std::string next_request_id(bool chat);

  ServerConfig config_;
  AsyncEngine& engine_;
  const Tokenizer* tokenizer_;
  std::unique_ptr<GrammarCompiler> grammar_compiler_;  // null: structured output refused
  ModelInfo model_info_;
  ServerMetrics metrics_;
  HttpTransport transport_;
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
