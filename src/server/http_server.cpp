#include "server/http_server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

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

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.http_status;
  res.set_content(dump_json(e.body()), "application/json");
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
    case StatusCode::kAborted:
      return error_of(503, "service_unavailable", s.message());
    default:
      return error_of(500, "internal_error", s.to_string());
  }
}

ApiError shutting_down() { return error_of(503, "service_unavailable", "The server is shutting down"); }

// The label of a path in nucleus_http_requests_total (bounded cardinality).
std::string endpoint_label(const std::string& path) {
  for (const char* p : {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})
    if (path == p) return p;
  return "other";
}

// cpp-httplib with a deeper listen queue: the packaged library listens with a
// backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, fixed when it was compiled), so a
// burst of new connections (a benchmark opening one per concurrent request)
// overflows it, and Linux answers the overflow with dropped handshakes, SYN
// cookies and, now and then, a reset connection. listen() again on the bound
// socket raises the backlog (up to net.core.somaxconn).
class DeepBacklogServer : public httplib::Server {
 public:
  void deepen_backlog() {
    if (svr_sock_ != INVALID_SOCKET) ::listen(svr_sock_, 4096);
  }
};

}  // namespace

class HttpServer::ActiveGuard {
 public:
  explicit ActiveGuard(HttpServer& server) : server_(server) {}
  ~ActiveGuard() { server_.leave(); }

 private:
  HttpServer& server_;
};

// One generation request; for a stream it lives in the content provider until
// the response is written (or the client is gone). Members are destroyed in
// reverse order: the Generation (aborting what still runs) before the
// request it refers to, the guard last.
struct HttpServer::StreamState {
  std::shared_ptr<ActiveGuard> guard;
  GenerationRequest request;
  std::unique_ptr<Generation> generation;
  std::unique_ptr<ResponseBuilder> builder;
  bool opened = false;

  // One call of httplib's chunked content provider: blocks for the next
  // deltas and writes them as server-sent events. False when the client is
  // gone (httplib then drops the connection; the destructor aborts).
  bool pump(httplib::DataSink& sink) {
    std::string out;
    auto event = [&](const json& j) { out += "data: " + dump_json(j) + "\n\n"; };
    bool last = false;
    if (!opened) {
      opened = true;
      for (const auto& c : builder->opening_chunks()) event(c);
    }
    if (out.empty()) {  // opening chunks go out at once, before any token
      for (const auto& d : generation->next()) {
        event(builder->chunk(d));
        if (!d.error.ok()) event(generation_error(d.error).body());  // a failed step: an OpenAI error event
      }
      if (generation->done()) {
        if (request.include_usage)
          event(builder->usage_chunk(generation->prompt_tokens(), generation->completion_tokens()));
        out += "data: [DONE]\n\n";
        last = true;
      }
    }
    if (!out.empty() && !sink.write(out.data(), out.size())) return false;
    if (last) sink.done();
    return true;
  }
};

HttpServer::HttpServer(ServerConfig config, AsyncEngine& engine, const Tokenizer* tokenizer,
                       const ChatTemplate* chat_template)
    : config_(std::move(config)), engine_(engine), tokenizer_(tokenizer), http_(std::make_unique<DeepBacklogServer>()) {
  model_info_.names = config_.served_model_names;
  model_info_.max_model_len = engine_.config().max_model_len;
  model_info_.vocab_size = engine_.vocab_size();
  model_info_.tokenizer = tokenizer_;
  model_info_.chat_template = chat_template;
  created_ = unix_now();
  id_salt_ = std::random_device{}();
  const int threads = std::max(config_.http_threads, 4);
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  http_->set_payload_max_length(64u << 20);
  http_->set_keep_alive_max_count(1000);  // httplib's default of 5 makes busy clients reconnect often
  routes();
}

HttpServer::~HttpServer() = default;

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

void HttpServer::routes() {
  http_->Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generation(req.body, /*chat=*/false, res);
  });
  http_->Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generation(req.body, /*chat=*/true, res);
  });
  http_->Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    json model = {{"id", model_info_.names[0]},
                  {"object", "model"},
                  {"created", created_},
                  {"owned_by", "nucleus"},
                  {"root", config_.model_dir},
                  {"parent", nullptr},
                  {"max_model_len", model_info_.max_model_len},
                  {"vocab_size", model_info_.vocab_size}};
    res.set_content(dump_json({{"object", "list"}, {"data", json::array({model})}}), "application/json");
  });
  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_)
      send_error(res, shutting_down());
    else if (Status f = engine_.failure(); !f.ok())
      send_error(res, error_of(503, "service_unavailable", f.message()));
    else
      res.status = 200;
  });
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(engine_.stats()), "text/plain; version=0.0.4; charset=utf-8");
  });
  // A known route asked with the wrong method: 405 naming the allowed one.
  auto wrong_method = [](const char* allowed) {
    return [allowed](const httplib::Request& req, httplib::Response& res) {
      res.set_header("Allow", allowed);
      send_error(res, error_of(405, "invalid_request_error",
                               "Method not allowed: " + req.method + " " + req.path + " (use " + allowed + ")"));
    };
  };
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    http_->Get(path, wrong_method("POST"));
    http_->Put(path, wrong_method("POST"));
    http_->Delete(path, wrong_method("POST"));
  }
  for (const char* path : {"/v1/models", "/health", "/metrics"}) {
    http_->Post(path, wrong_method("GET"));
    http_->Put(path, wrong_method("GET"));
    http_->Delete(path, wrong_method("GET"));
  }
  // Routing misses (404) and httplib's own refusals get an OpenAI error body;
  // responses that already carry one are left alone.
  http_->set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        const std::string msg = res.status == 404
                                    ? "Not found: " + req.method + " " + req.path
                                    : "HTTP " + std::to_string(res.status) + " for " + req.method + " " + req.path;
        send_error(res, error_of(res.status, "invalid_request_error", msg));
        return httplib::Server::HandlerResponse::Handled;
      }));
  http_->set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    NUCLEUS_LOG_ERROR("{} {}: {}", req.method, req.path, what);
    send_error(res, error_of(500, "internal_error", "Internal error: " + what));
  });
  http_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    metrics_.record_http(endpoint_label(req.path), res.status);
    NUCLEUS_LOG_DEBUG("{} {} -> {}", req.method, req.path, res.status);
  });
}

void HttpServer::handle_generation(const std::string& body, bool chat, httplib::Response& res) {
  const double arrival = steady_seconds();
  auto state = std::make_shared<StreamState>();
  state->guard = enter();
  if (!state->guard) return send_error(res, shutting_down());
  auto parsed = chat ? parse_chat_request(body, model_info_) : parse_completion_request(body, model_info_);
  if (const ApiError* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
  state->request = std::move(std::get<GenerationRequest>(parsed));
  const std::string id = next_request_id(chat);
  state->generation = std::make_unique<Generation>(engine_, tokenizer_, metrics_, id, state->request, arrival);
  if (Status s = state->generation->start(); !s.ok()) return send_error(res, engine_error(s));
  state->builder = std::make_unique<ResponseBuilder>(ResponseHeader{id, unix_now(), model_info_.names[0]},
                                                     state->request, tokenizer_, state->generation->num_choices());
  Generation& gen = *state->generation;
  if (!state->request.stream) {
    while (!gen.done())
      for (const auto& d : gen.next()) state->builder->add(d);
    if (!gen.error().ok()) return send_error(res, generation_error(gen.error()));
    res.set_content(dump_json(state->builder->whole(gen.prompt_tokens(), gen.completion_tokens())), "application/json");
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider("text/event-stream",
                                   [state](size_t, httplib::DataSink& sink) { return state->pump(sink); });
}

Status HttpServer::bind() {
  // SO_REUSEADDR only: the library's default also sets SO_REUSEPORT, which
  // would let a second server bind the same port and split the requests.
  http_->set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  if (config_.port == 0) {
    port_ = http_->bind_to_any_port(config_.host);
    if (port_ < 0) return invalid_argument("--host " + config_.host + ": cannot bind a port");
  } else {
    if (!http_->bind_to_port(config_.host, config_.port))
      return invalid_argument("cannot listen on " + config_.host + ":" + std::to_string(config_.port) +
                              " (address in use or not local; pick --host / --port)");
    port_ = config_.port;
  }
  static_cast<DeepBacklogServer*>(http_.get())->deepen_backlog();
  return ok_status();
}

bool HttpServer::serve() {
  const bool ok = http_->listen_after_bind();
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
  http_->stop();
}

}  // namespace nucleus::server
