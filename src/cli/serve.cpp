// nucleus serve: the OpenAI-compatible HTTP server (docs/server.md).
//   nucleus serve --model DIR [--host 127.0.0.1] [--port 8000]
//                 [--served-model-name NAME] [engine flags]
//                 [--tool-call-parser deepseek_v3|deepseek_v31|kimi_k2 --enable-auto-tool-choice]
//                 [--reasoning-parser deepseek_r1]
// SIGINT / SIGTERM: stop taking requests, finish those in flight (at most
// --shutdown-timeout seconds, then abort them), exit 0. A second signal
// aborts at once. An engine that fails (a step it cannot recover from:
// LLMEngine::failure) drains the same way, logs why and exits 1.
#include <pthread.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <thread>

#include "cli/commands.h"
#include "cli/engine_args.h"
#include "core/logging.h"
#include "server/async_engine.h"
#include "server/http_server.h"

namespace nucleus::cli {

namespace {

// The last path component of the model directory ("models/tiny-dsv3/" ->
// "tiny-dsv3").
std::string default_served_name(const std::string& model_dir) {
  std::filesystem::path p = std::filesystem::path(model_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  std::string name = p.filename().string();
  return name.empty() ? model_dir : name;
}

}  // namespace

int run_serve(int argc, char** argv) {
  CLI::App app{"nucleus serve: OpenAI-compatible HTTP server", "nucleus serve"};
  EngineArgs args;
  args.add_to(app);
  server::ServerConfig config;
  std::string served_name;
  app.add_option("--host", config.host, "Address to listen on")->capture_default_str();
  app.add_option("--port", config.port, "Port to listen on (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--served-model-name", served_name,
                 "Model name in the API (default: the model directory's last component)");
  app.add_flag("--skip-tokenizer-init", args.skip_tokenizer_init,
               "Load no tokenizer: prompts must be token ids, responses carry token_ids and empty text "
               "(e.g. dummy weights from --config)");
  // Connection and request limits (docs/server.md, "Limits").
  server::HttpLimits& conn = config.http;
  server::RequestLimits& lim = config.requests;
  app.add_option("--max-connections,--http-threads", conn.max_connections,
                 "Open connections at most (streams and idle keep-alive ones included); more are refused with 503")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--max-body-bytes", conn.max_body_bytes,
                 "Request body size at most, after gzip/deflate is undone; larger is 413")
      ->check(CLI::Range(size_t{1024}, size_t{1} << 34))
      ->capture_default_str();
  app.add_option("--max-header-bytes", conn.max_header_bytes, "Request line and headers at most; larger is 431")
      ->check(CLI::Range(size_t{1024}, size_t{1} << 24))
      ->capture_default_str();
  app.add_option("--request-timeout", conn.request_timeout_s,
                 "Seconds from a request's first byte to its last (header and body); slower is 408")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  app.add_option("--keep-alive-timeout", conn.keep_alive_timeout_s,
                 "Seconds an idle connection is kept open between requests")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  app.add_option("--write-timeout", conn.write_timeout_s,
                 "Seconds a response write may make no progress before the connection is dropped")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  app.add_option("--max-json-depth", lim.max_json_depth, "Nesting of JSON arrays and objects in a body at most")
      ->check(CLI::Range(2, 10000))
      ->capture_default_str();
  app.add_option("--max-json-values", lim.max_json_values,
                 "JSON values (numbers, strings, arrays, objects, ...) in a body at most")
      ->check(CLI::Range(int64_t{16}, int64_t{1} << 34))
      ->capture_default_str();
  app.add_option("--max-choices", lim.max_choices, "n x prompts (engine requests) per HTTP request at most")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-stop-strings", lim.max_stop_strings, "Entries of 'stop' at most")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-stop-bytes", lim.max_stop_bytes, "Bytes of all 'stop' strings together at most")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--max-guided-choices", lim.max_guided_choices,
                 "Strings of a structured-output choice list at most (compile time grows faster than the list)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-stop-token-ids", lim.max_stop_token_ids, "Entries of 'stop_token_ids' at most")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  // Chat output parsers, with vLLM's flag names (docs/server.md, "Tool calls and reasoning").
  std::string tool_call_parser, reasoning_parser;
  app.add_option("--tool-call-parser", tool_call_parser,
                 "Parse tool calls out of chat output in this model's format (requests with 'tools' and "
                 "tool_choice \"auto\"; needs --enable-auto-tool-choice)")
      ->check(CLI::IsMember(server::tool_call_format_names()));
  app.add_flag("--enable-auto-tool-choice", config.enable_auto_tool_choice,
               "Let the model choose to call tools (tool_choice \"auto\", the default with 'tools'); needs "
               "--tool-call-parser");
  app.add_option("--reasoning-parser", reasoning_parser,
                 "Split chat output into 'reasoning_content' (up to </think>) and 'content'")
      ->check(CLI::IsMember({"deepseek_r1"}));
  app.add_option("--shutdown-timeout", config.shutdown_timeout_s,
                 "On SIGINT/SIGTERM, seconds in-flight requests may take before they are aborted")
      ->check(non_negative_number())
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return exit_code_for(app, e);
  }
  init_logging();
  if (config.enable_auto_tool_choice && tool_call_parser.empty()) {
    std::fprintf(stderr, "error: --enable-auto-tool-choice requires --tool-call-parser\n");
    return 2;  // a usage error
  }
  if (!tool_call_parser.empty()) config.tool_call_parser = server::tool_call_format_from_name(tool_call_parser);
  config.reasoning_parser = !reasoning_parser.empty();
  if ((config.tool_call_parser || config.reasoning_parser) && args.skip_tokenizer_init) {
    std::fprintf(stderr, "error: --tool-call-parser and --reasoning-parser read text: they need the tokenizer "
                         "(drop --skip-tokenizer-init)\n");
    return 2;  // a usage error
  }

  // Every thread started from here on inherits this mask, so the signals
  // reach only the sigwait() thread below. SIGUSR1 wakes it at exit.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not a crash

  auto loaded = load_engine(args);
  if (!loaded.ok()) {
    std::cerr << "error: " << loaded.status().message() << "\n";
    return 1;
  }
  std::unique_ptr<ChatTemplate> chat_template;
  if (!loaded->tokenizer && !args.skip_tokenizer_init) {
    std::fprintf(stderr,
                 "error: serve needs the model's tokenizer files (tokenizer.json or tiktoken.model, and "
                 "tokenizer_config.json); "
                 "--skip-tokenizer-init serves token-id prompts without them\n");
    return 1;
  }
  if (!loaded->tokenizer) {
    NUCLEUS_LOG_WARN("--skip-tokenizer-init: token-id prompts only; chat, stop strings and logprobs are refused");
  } else if (!loaded->tokenizer->chat_template().empty()) {
    auto t = ChatTemplate::parse(loaded->tokenizer->chat_template());
    if (t.ok())
      chat_template = std::make_unique<ChatTemplate>(std::move(*t));
    else {
      NUCLEUS_LOG_WARN("chat template not usable, /v1/chat/completions will refuse: {}", t.status().message());
      config.chat_template_error = t.status().message();
    }
  } else {
    NUCLEUS_LOG_WARN("the model has no chat template; /v1/chat/completions will refuse requests");
  }
  // vLLM refuses a tokenizer without the parser's markers; here they are
  // matched in the text whatever tokens spell them, so a missing token only
  // means the model was not trained on the format.
  if (loaded->tokenizer && (config.tool_call_parser || config.reasoning_parser)) {
    std::vector<std::string> markers;
    if (config.tool_call_parser) markers = server::tool_call_markers(*config.tool_call_parser);
    if (config.reasoning_parser) markers.insert(markers.end(), {"<think>", "</think>"});
    for (const auto& m : markers)
      if (!loaded->tokenizer->token_to_id(m))
        NUCLEUS_LOG_WARN("the tokenizer has no token '{}': the output parser matches it as text", m);
  }
  // With --config (dummy weights, no directory) the name is the config file's.
  const std::string model_arg = args.config_file.empty() ? args.model : args.config_file;
  config.served_model_names = {served_name.empty() ? default_served_name(model_arg) : served_name};
  if (model_arg != config.served_model_names[0]) config.served_model_names.push_back(model_arg);
  config.model_dir = model_arg;

  server::AsyncEngine engine(std::move(loaded->engine));
  server::HttpServer http(config, engine, loaded->tokenizer.get(), chat_template.get());
  if (Status s = http.bind(); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 1;
  }
  NUCLEUS_LOG_INFO("serving '{}' on http://{}:{}", config.served_model_names[0], config.host, http.bound_port());

  std::atomic<bool> exiting{false};
  std::thread drain;
  std::thread waiter([&] {
    int received = 0;
    for (;;) {
      int sig = 0;
      sigwait(&signals, &sig);
      if (exiting) return;
      if (sig == SIGUSR1) continue;
      if (++received == 1)
        drain = std::thread([&] { http.shutdown(); });
      else
        http.force();
    }
  });
  // The engine failing: the same drain as a signal (its requests have
  // already finished with an error; new ones get 503), then exit 1.
  engine.on_failure([&](const Status& why) {
    NUCLEUS_LOG_ERROR("the engine failed, shutting the server down: {}", why.message());
    pthread_kill(waiter.native_handle(), SIGTERM);
  });
  const bool served = http.serve();
  exiting = true;
  pthread_kill(waiter.native_handle(), SIGUSR1);
  waiter.join();
  if (drain.joinable()) drain.join();
  engine.shutdown();
  if (!served) {
    NUCLEUS_LOG_ERROR("the listening socket failed");
    return 1;
  }
  if (Status f = engine.failure(); !f.ok()) {
    NUCLEUS_LOG_ERROR("server stopped: the engine failed: {}", f.message());
    return 1;
  }
  NUCLEUS_LOG_INFO("server stopped");
  return 0;
}

}  // namespace nucleus::cli
