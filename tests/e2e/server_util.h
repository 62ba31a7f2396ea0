// Test scaffolding for `nucleus serve`: the binary as a child process on a
// free loopback port, HTTP helpers, and the Prometheus parser. Header-only,
// shared by the server test files.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

extern char** environ;

namespace nucleus::testing {

using nlohmann::json;

// A write to a connection the server closed must fail, not kill the test.
inline const bool kIgnoreSigpipe = (signal(SIGPIPE, SIG_IGN), true);

inline std::string binary() {
  const char* bin = std::getenv("NUCLEUS_BIN");
  return bin ? bin : "";
}

inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A child process with stdout and stderr in `log`.
inline pid_t spawn(const std::vector<std::string>& args, const std::string& log) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// Waits for the child; its exit status, or -1 (killed, or still running
// after timeout_s: then it is killed).
inline int wait_exit(pid_t pid, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int st = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  return -1;
}

// `nucleus serve` on the tiny model; killed at the end unless already gone.
// `env`: NAME=VALUE settings for the child only.
class ServerProcess {
 public:
  explicit ServerProcess(const std::vector<std::string>& extra_args = {}, const std::vector<std::string>& env = {}) {
    port_ = free_port();
    log_ = testing::make_temp_dir("nucleus_srv") + "/server.log";
    std::vector<std::string> args = {
        binary(),    "serve",  "--device",           "cpu", "--model", testing::model_path("tiny-dsv3"), "--host",
        "127.0.0.1", "--port", std::to_string(port_)};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));  // copied by the spawn below
    pid_ = spawn(args, log_);
    for (const auto& e : env) unsetenv(e.substr(0, e.find('=')).c_str());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (pid_ > 0 && std::chrono::steady_clock::now() < deadline) {
      auto res = client().Get("/health");
      if (res && res->status == 200) {
        ready_ = true;
        break;
      }
      int st;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool ready() const { return ready_; }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  std::string log() const { return read_file(log_); }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60);
    return c;
  }
  // SIGTERM, then the exit status (-1: did not exit within timeout_s).
  int terminate(double timeout_s = 20.0) {
    kill(pid_, SIGTERM);
    return exit_status(timeout_s);
  }
  // The exit status once the server exits by itself (-1: still running
  // after timeout_s, then killed).
  int exit_status(double timeout_s) {
    const int st = wait_exit(pid_, timeout_s);
    pid_ = -1;
    return st;
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

inline Reply post(const ServerProcess& s, const std::string& path, const std::string& body) {
  auto res = s.client().Post(path.c_str(), body, "application/json");
  if (!res) return {};
  return {res->status, json::parse(res->body, nullptr, false), res->body};
}
inline Reply post(const ServerProcess& s, const std::string& path, const json& body) { return post(s, path, body.dump()); }

// Prometheus text: every line a comment (# HELP / # TYPE) or a sample
// `name{label="v",...} value`; returns the samples by "name{labels}".
inline std::map<std::string, double> parse_metrics(const std::string& text) {
  static const std::regex sample(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})? )"
      R"(([-+]?[0-9.]+([eE][-+]?[0-9]+)?|[+-]Inf|NaN)$)");
  static const std::regex help(R"(^# HELP [a-zA-Z_:][a-zA-Z0-9_:]* .*$)");
  static const std::regex type(R"(^# TYPE [a-zA-Z_:][a-zA-Z0-9_:]* (counter|gauge|histogram|summary|untyped)$)");
  std::map<std::string, double> out;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) {
    if (line.empty()) continue;
    std::smatch m;
    if (std::regex_match(line, help) || std::regex_match(line, type)) continue;
    EXPECT_TRUE(std::regex_match(line, m, sample)) << "not a Prometheus line: " << line;
    if (m.size() > 4) out[m[1].str() + m[2].str()] = std::stod(m[4].str() == "+Inf" ? "inf" : m[4].str());
  }
  return out;
}

}  // namespace nucleus::testing
