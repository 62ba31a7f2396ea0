// `nucleus serve` with a failing step (NUCLEUS_FAULT_INJECT, test only): the
// request of the failed step gets a 500 error body (non-streaming) or an
// error finish and error event (streaming), the server then answers the
// same request exactly as without the fault and holds no KV block; a fatal
// fault answers 503 and the server drains and exits 1, saying why.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "test_util.h"

extern char** environ;

namespace nucleus {
namespace {

using nlohmann::json;

const bool kIgnoreSigpipe = (signal(SIGPIPE, SIG_IGN), true);

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// `nucleus serve --device cpu` on tiny-dsv3 with NUCLEUS_FAULT_INJECT=fault,
// output in a log file; killed at the end unless it exited.
class Server {
 public:
  explicit Server(const std::string& fault) {
    port_ = free_port();
    log_ = testing::make_temp_dir("nucleus_steperr") + "/server.log";
    const char* bin = std::getenv("NUCLEUS_BIN");
    std::vector<std::string> args = {bin ? bin : "", "serve", "--device", "cpu", "--model",
                                     testing::model_path("tiny-dsv3"), "--port", std::to_string(port_)};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    setenv("NUCLEUS_FAULT_INJECT", fault.c_str(), 1);  // the child's environment
    if (posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
    unsetenv("NUCLEUS_FAULT_INJECT");
    posix_spawn_file_actions_destroy(&fa);
    for (int i = 0; i < 600 && pid_ > 0 && !ready_; ++i) {
      auto res = client().Get("/health");
      ready_ = res && res->status == 200;
      if (!ready_) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~Server() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool ready() const { return ready_; }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60);
    return c;
  }
  std::string log() const {
    std::ifstream f(log_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  // The exit status once the server exits by itself; -1 after timeout_s.
  int wait_exit(double timeout_s) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < deadline) {
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  std::string log_;
  bool ready_ = false;
};

struct Reply {
  int status = 0;
  json body;
  std::string raw;
};

Reply post(const Server& s, const json& body) {
  auto res = s.client().Post("/v1/completions", body.dump(), "application/json");
  if (!res) return {};
  return {res->status, json::parse(res->body, nullptr, false), res->body};
}

json ref_case() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  return json::parse(in)["tiny-dsv3"][0];
}

json request(bool stream) {
  const json c = ref_case();
  return {{"prompt", c["prompt"]}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}, {"stream", stream}};
}

double kv_blocks_used(const Server& s) {
  auto res = s.client().Get("/metrics");
  if (!res) return -1;
  std::stringstream ss(res->body);
  std::string line;
  while (std::getline(ss, line))
    if (line.rfind("nucleus_kv_blocks_used ", 0) == 0) return std::stod(line.substr(23));
  return -1;
}

TEST(ServerStepErrorTest, FailedStepIs500ThenTheSameRequestSucceeds) {
  Server s("embedding:2");  // the first request's first decode step
  ASSERT_TRUE(s.ready()) << s.log();
  Reply r = post(s, request(false));
  ASSERT_EQ(r.status, 500) << r.raw;
  EXPECT_EQ(r.body["error"]["type"], "internal_error") << r.raw;
  const std::string msg = r.body["error"]["message"].get<std::string>();
  EXPECT_NE(msg.find("injected fault in op embedding"), std::string::npos) << msg;
  EXPECT_EQ(kv_blocks_used(s), 0);
  auto health = s.client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  r = post(s, request(false));
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["text"], ref_case()["greedy_text"]);
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(kv_blocks_used(s), 0);
  EXPECT_NE(s.log().find("step 2 failed"), std::string::npos) << s.log();
}

TEST(ServerStepErrorTest, FailedStepEndsAStreamWithAnErrorEvent) {
  Server s("embedding:3");
  ASSERT_TRUE(s.ready()) << s.log();
  auto res = s.client().Post("/v1/completions", request(true).dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);  // the stream had begun
  std::vector<json> events;
  bool done = false;
  std::stringstream ss(res->body);
  std::string line;
  while (std::getline(ss, line)) {
    if (line.rfind("data: ", 0) != 0) continue;
    if (line == "data: [DONE]")
      done = true;
    else
      events.push_back(json::parse(line.substr(6)));
  }
  EXPECT_TRUE(done) << res->body;
  ASSERT_GE(events.size(), 2u) << res->body;
  const json& finish = events[events.size() - 2];
  ASSERT_TRUE(finish.contains("choices")) << res->body;
  EXPECT_EQ(finish["choices"][0]["finish_reason"], "error") << res->body;
  const json& error = events.back();
  ASSERT_TRUE(error.contains("error")) << res->body;
  EXPECT_EQ(error["error"]["type"], "internal_error");
  EXPECT_NE(error["error"]["message"].get<std::string>().find("injected fault in op embedding"), std::string::npos);
  EXPECT_EQ(kv_blocks_used(s), 0);
  Reply r = post(s, request(false));
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["text"], ref_case()["greedy_text"]);
}

TEST(ServerStepErrorTest, FatalFaultIs503AndTheServerExitsOne) {
  Server s("embedding:2:fatal");
  ASSERT_TRUE(s.ready()) << s.log();
  Reply r = post(s, request(false));
  ASSERT_EQ(r.status, 503) << r.raw;
  EXPECT_EQ(r.body["error"]["type"], "service_unavailable") << r.raw;
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("injected fault"), std::string::npos) << r.raw;
  // Later requests are refused while it drains (or find it gone).
  Reply later = post(s, request(false));
  EXPECT_TRUE(later.status == 503 || later.status == 0) << later.raw;
  EXPECT_EQ(s.wait_exit(30), 1) << s.log();
  const std::string log = s.log();
  EXPECT_NE(log.find("the engine failed, shutting the server down"), std::string::npos) << log;
  EXPECT_NE(log.find("server stopped: the engine failed"), std::string::npos) << log;
}

}  // namespace
}  // namespace nucleus
