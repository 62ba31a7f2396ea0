#include "server/http_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "core/logging.h"
#include "server/generation.h"
#include "server/responses.h"

namespace nucleus::server {

using nlohmann::json;

namespace {

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// How often a handler waiting for tokens checks whether its client went away.
constexpr double kDisconnectCheckSeconds = 0.1;

void send_error(HttpResponder& res, const ApiError& e, const HttpHeaders& extra = {}) {
  res.send(e.http_status, "application/json", dump_json(e.body()), extra);
}

ApiError error_of(int http_status, const std::string& type, const std::string& message) {
  ApiError e;
  e.http_status = http_status;
  e.type = type;
  e.message = message;
  return e;
}

// A Status from the engine (add_request) as the client's error.
ApiError engine_error(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      return error_of(400, "invalid_request_error", s.message());
    case StatusCode::kResourceExhausted: {
      ApiError e = error_of(400, "invalid_request_error", s.message());
      e.param = "max_tokens";
      return e;
    }
    case StatusCode::kUnsupported:  // a parameter (or combination) this server does not serve
      return error_of(400, "invalid_request_error", s.message());
    case StatusCode::kAborted:
      return error_of(503, "service_unavailable", s.message());
    default:
      return error_of(500, "internal_error", s.to_string());
  }
}

ApiError shutting_down() { return error_of(503, "service_unavailable", "The server is shutting down"); }

// The label of a path in nucleus_http_requests_total (bounded cardinality).
std::string endpoint_label(const std::string& path) {
  for (const char* p :
       {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize"})
    if (path == p) return p;
  return "other";
}

}  // namespace

class HttpServer::ActiveGuard {
 public:
  explicit ActiveGuard(HttpServer& server) : server_(server) {}
  ~ActiveGuard() { server_.leave(); }

 private:
  HttpServer& server_;
};

HttpServer::HttpServer(ServerConfig config, AsyncEngine& engine, const Tokenizer* tokenizer,
                       const ChatTemplate* chat_template)
    : config_(std::move(config)),
      engine_(engine),
      tokenizer_(tokenizer),
      transport_(config_.http, [this](const HttpRequest& req, HttpResponder& res) { handle(req, res); }) {
  model_info_.names = config_.served_model_names;
  model_info_.max_model_len = engine_.config().max_model_len;
  model_info_.speculative = engine_.config().speculative.enabled();
  model_info_.vocab_size = engine_.vocab_size();
  model_info_.tokenizer = tokenizer_;
  model_info_.chat_template = chat_template;
  model_info_.chat_template_error = config_.chat_template_error;
  model_info_.limits = config_.requests;
  model_info_.tool_call_parser = config_.tool_call_parser;
  model_info_.enable_auto_tool_choice = config_.enable_auto_tool_choice;
  model_info_.reasoning_parser = config_.reasoning_parser;
  model_info_.limits.max_elements = std::max<int64_t>(model_info_.max_model_len, 4096);
  if (tokenizer_) {  // structured output: the vocabulary as the grammar compiler sees it
    auto compiler = GrammarCompiler::create(*tokenizer_, model_info_.vocab_size, engine_.config().eos_token_ids);
    if (compiler.ok())
      grammar_compiler_ = std::move(compiler).value();
    else
      NUCLEUS_LOG_WARN("structured output is off: {}", compiler.status().message());
    model_info_.grammar_compiler = grammar_compiler_.get();
  }
  created_ = unix_now();
  id_salt_ = std::random_device{}();
}

HttpServer::~HttpServer() { transport_.stop(); }

std::shared_ptr<HttpServer::ActiveGuard> HttpServer::enter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (draining_) return nullptr;
  ++active_;
  return std::make_shared<ActiveGuard>(*this);
}

void HttpServer::leave() {
  std::lock_guard<std::mutex> lock(mu_);
  --active_;
  cv_.notify_all();
}

std::string HttpServer::next_request_id(bool chat) {
  return fmt::format("{}-{:08x}{:08x}", chat ? "chatcmpl" : "cmpl", id_salt_ & 0xffffffffu, next_id_++);
}

void HttpServer::handle(const HttpRequest& req, HttpResponder& res) {
  // Each known route with the one method it takes; another method is 405.
  static const std::pair<const char*, const char*> kRoutes[] = {
      {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}, {"/v1/models", "GET"},
      {"/health", "GET"},          {"/metrics", "GET"},              {"/tokenize", "POST"},
      {"/detokenize", "POST"}};
  const char* allowed = nullptr;
  for (const auto& [path, method] : kRoutes)
    if (req.path == path) allowed = method;
  if (!allowed) {
    send_error(res, error_of(404, "invalid_request_error", "Not found: " + req.method + " " + req.path));
  } else if (req.method != allowed) {
    send_error(res,
               error_of(405, "invalid_request_error",
                        "Method not allowed: " + req.method + " " + req.path + " (use " + allowed + ")"),
               {{"Allow", allowed}});
  } else if (req.path == "/v1/completions" || req.path == "/v1/chat/completions") {
    handle_generation(req.body, req.path == "/v1/chat/completions", res);
  } else if (req.path == "/tokenize" || req.path == "/detokenize") {
    auto r = req.path == "/tokenize" ? tokenize_request(req.body, model_info_) : detokenize_request(req.body, model_info_);
    if (const ApiError* e = std::get_if<ApiError>(&r))
      send_error(res, *e);
    else
      res.send(200, "application/json", dump_json(std::get<json>(r)));
  } else if (req.path == "/v1/models") {
    json model = {{"id", model_info_.names[0]},
                  {"object", "model"},
                  {"created", created_},
                  {"owned_by", "nucleus"},
                  {"root", config_.model_dir},
                  {"parent", nullptr},
                  {"max_model_len", model_info_.max_model_len},
                  {"vocab_size", model_info_.vocab_size}};
    res.send(200, "application/json", dump_json({{"object", "list"}, {"data", json::array({model})}}));
  } else if (req.path == "/health") {
    std::unique_lock<std::mutex> lock(mu_);
    const bool draining = draining_;
    lock.unlock();
    if (draining)
      send_error(res, shutting_down());
    else if (Status f = engine_.failure(); !f.ok())
      send_error(res, error_of(503, "service_unavailable", f.message()));
    else
      res.send(200, "", "");
  } else {
    res.send(200, "text/plain; version=0.0.4; charset=utf-8", metrics_.render(engine_.stats()));
  }
  // 499 (nginx's "client closed request"): the client went away before any answer.
  metrics_.record_http(endpoint_label(req.path), res.responded() ? res.status() : 499);
  NUCLEUS_LOG_DEBUG("{} {} -> {}", req.method, req.path, res.status());
}

void HttpServer::handle_generation(const std::string& body, bool chat, HttpResponder& res) {
  const double arrival = steady_seconds();
  // Destroyed in reverse order: the Generation (aborting what still runs, so
  // a client that went away frees its KV blocks) before the request it
  // refers to, the guard last.
  auto guard = enter();
  if (!guard) return send_error(res, shutting_down());
  auto parsed = chat ? parse_chat_request(body, model_info_) : parse_completion_request(body, model_info_);
  if (const ApiError* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
  const GenerationRequest request = std::move(std::get<GenerationRequest>(parsed));
  parsed = ApiError{};  // the parsed copy's memory goes now, not at the end of the request
  const std::string id = next_request_id(chat);
  Generation gen(engine_, tokenizer_, metrics_, id, request, arrival);
  if (Status s = gen.start(); !s.ok()) return send_error(res, engine_error(s));
  ResponseBuilder builder(ResponseHeader{id, unix_now(), model_info_.names[0]}, request, tokenizer_,
                          gen.num_choices());
  auto event = [](const json& j) { return "data: " + dump_json(j) + "\n\n"; };
  if (request.stream) {
    res.start_chunked(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
    std::string out;
    for (const auto& c : builder.opening_chunks()) out += event(c);
    if (!res.write_chunk(out)) return;
  }
  while (!gen.done()) {
    if (res.client_gone()) return;  // ~Generation aborts the choices still running
    std::string out;
    for (const auto& d : gen.next(kDisconnectCheckSeconds)) {
      if (!request.stream) {
        builder.add(d);
        continue;
      }
      for (const auto& c : builder.chunks(d)) out += event(c);
      if (!d.error.ok()) out += event(generation_error(d.error).body());  // a failed step: an OpenAI error event
    }
    if (!out.empty() && !res.write_chunk(out)) return;
  }
  if (!request.stream) {
    if (!gen.error().ok()) return send_error(res, generation_error(gen.error()));
    res.send(200, "application/json", dump_json(builder.whole(gen.prompt_tokens(), gen.completion_tokens())));
    return;
  }
  std::string out;
  if (request.include_usage) out += event(builder.usage_chunk(gen.prompt_tokens(), gen.completion_tokens()));
  out += "data: [DONE]\n\n";
  if (res.write_chunk(out)) res.finish_chunked();
}

Status HttpServer::bind() { return transport_.bind(config_.host, config_.port); }

bool HttpServer::serve() {
  const bool ok = transport_.serve();
  std::lock_guard<std::mutex> lock(mu_);
  return ok || draining_;
}

void HttpServer::force() {
  std::lock_guard<std::mutex> lock(mu_);
  force_ = true;
  cv_.notify_all();
}

void HttpServer::shutdown() {
  std::unique_lock<std::mutex> lock(mu_);
  draining_ = true;
  NUCLEUS_LOG_INFO("shutting down: {} request(s) in flight, finishing them (at most {} s)", active_,
                   config_.shutdown_timeout_s);
  cv_.wait_for(lock, std::chrono::duration<double>(config_.shutdown_timeout_s), [&] { return active_ == 0 || force_; });
  // Past the grace period: abort what is left (their clients get finish_reason
  // "abort"), retrying for requests that were being admitted meanwhile.
  for (int i = 0; i < 100 && active_ > 0; ++i) {
    lock.unlock();
    engine_.abort_all();
    lock.lock();
    cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return active_ == 0; });
  }
  lock.unlock();
  transport_.stop();
}

}  // namespace nucleus::server
