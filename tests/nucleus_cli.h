// Running the `nucleus` binary from a test: its exit status, stdout and
// stderr, and the JSON lines `generate --json` prints.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace nucleus::testing {

struct RunResult {
  int status = -1;  // the exit status, or -1 if it did not exit normally
  std::string out, err;
};

// `env ENV $NUCLEUS_BIN ARGS` (nucleus from PATH without NUCLEUS_BIN), its
// stderr kept in DIR/stderr.txt.
inline RunResult run_nucleus(const std::string& args, const std::string& env, const std::string& dir) {
  const char* bin = std::getenv("NUCLEUS_BIN");
  const std::string err_file = dir + "/stderr.txt";
  const std::string cmd = "env " + env + " " + (bin ? bin : "nucleus") + " " + args + " 2>" + err_file;
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream e(err_file);
  std::stringstream ss;
  ss << e.rdbuf();
  r.err = ss.str();
  return r;
}

// The JSON objects of the non-empty lines of `s`.
inline std::vector<nlohmann::json> json_lines(const std::string& s) {
  std::vector<nlohmann::json> out;
  std::stringstream ss(s);
  std::string line;
  while (std::getline(ss, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace nucleus::testing
