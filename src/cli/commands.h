// Subcommands of the nucleus binary; each parses its own flags.
#pragma once

#include <CLI/CLI.hpp>

namespace nucleus::cli {

// Exit status of a command-line parse failure: 0 for --help, 2 for every
// usage error (CLI11's own codes are folded into 2). Prints the message.
inline int exit_code_for(const CLI::App& app, const CLI::ParseError& e) {
  const int rc = app.exit(e);
  return rc == 0 ? 0 : 2;
}
// Checks for numeric flags with plain messages ("must be > 0, got 0"), in
// place of CLI::PositiveNumber and CLI::NonNegativeNumber, whose messages
// print their range with the largest double in full (309 digits).
inline CLI::Validator positive_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v)) return "must be a number, got '" + s + "'";
        return v > 0 ? "" : "must be > 0, got " + s;
      },
      "POSITIVE");
}
inline CLI::Validator non_negative_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v)) return "must be a number, got '" + s + "'";
        return v >= 0 ? "" : "must be >= 0, got " + s;
      },
      "NONNEGATIVE");
}
int run_generate(int argc, char** argv);
int run_serve(int argc, char** argv);        // nucleus serve
int run_bench_serve(int argc, char** argv);  // nucleus bench serve
int run_bench_latency(int argc, char** argv);  // nucleus bench latency
int run_prebuild_kernels(int argc, char** argv);  // nucleus prebuild-kernels
}  // namespace nucleus::cli
