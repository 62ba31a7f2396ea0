// nucleus: DeepSeek-family inference engine.
//   nucleus generate --model DIR [...]   offline batch generation
//   nucleus serve --model DIR [...]      OpenAI-compatible HTTP server
//   nucleus bench serve --base-url URL   serving benchmark against a running server
//   nucleus bench latency --model DIR    prefill/decode latency, % of roofline
//   nucleus prebuild-kernels             compile the decode width builds into the kernel cache
//   nucleus --help-env                   the NUCLEUS_* environment switches (core/knobs.cpp)
// Run `nucleus <command> --help` for a command's flags.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/knobs.h"

namespace {
// To stdout when asked for (--help), to stderr after a usage error.
void usage(std::FILE* to) {
  std::fprintf(to,
               "usage: nucleus <command> [flags]\n"
               "commands:\n"
               "  generate      offline batch generation (prompts in, text or JSON lines out)\n"
               "  serve         OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)\n"
               "  bench serve   serving benchmark (TTFT, TPOT, ITL, throughput) against a server\n"
               "  bench latency prefill/decode latency and %% of roofline at given batch sizes\n"
               "  prebuild-kernels  compile the decode width builds into the kernel cache (no GPU needed)\n"
               "run 'nucleus <command> --help' for the command's flags,\n"
               "'nucleus --help-env' for the NUCLEUS_* environment switches\n");
}

// vLLM's short flag -tp (CLI11 allows one-letter short flags only): rewritten
// to --tensor-parallel-size before a command parses its flags.
void expand_short_flags(int argc, char** argv) {
  static std::string long_flag = "--tensor-parallel-size";
  static std::vector<std::string> joined;
  joined.reserve(argc);
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "-tp")) {
      argv[i] = long_flag.data();
    } else if (!std::strncmp(argv[i], "-tp=", 4)) {
      joined.push_back(long_flag + (argv[i] + 3));
      argv[i] = joined.back().data();
    }
  }
}
}  // namespace

int main(int argc, char** argv) {
  expand_short_flags(argc, argv);
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  if (cmd == "--help-env") {
    std::fputs(nucleus::knobs_help_text().c_str(), stdout);
    return 0;
  }
  // An unknown NUCLEUS_* variable is ignored: say so (a typo would otherwise
  // silently leave a switch at its default).
  for (const nucleus::UnknownEnvSwitch& u : nucleus::unknown_env_switches())
    std::fprintf(stderr, "nucleus: warning: %s is not a nucleus environment switch and is ignored%s%s%s; "
                 "'nucleus --help-env' lists them\n",
                 u.name.c_str(), u.nearest.empty() ? "" : " (did you mean ", u.nearest.c_str(),
                 u.nearest.empty() ? "" : "?)");
  // The subcommand sees argv without the command word.
  if (cmd == "generate") return nucleus::cli::run_generate(argc - 1, argv + 1);
  if (cmd == "serve") return nucleus::cli::run_serve(argc - 1, argv + 1);
  if (cmd == "prebuild-kernels") return nucleus::cli::run_prebuild_kernels(argc - 1, argv + 1);
  if (cmd == "bench" && argc >= 3 && !std::strcmp(argv[2], "serve"))
    return nucleus::cli::run_bench_serve(argc - 2, argv + 2);
  if (cmd == "bench" && argc >= 3 && !std::strcmp(argv[2], "latency"))
    return nucleus::cli::run_bench_latency(argc - 2, argv + 2);
  if (cmd == "bench") {
    std::fprintf(stderr, "usage: nucleus bench serve|latency [flags]; run 'nucleus bench <serve|latency> --help'\n");
    return argc >= 3 && (!std::strcmp(argv[2], "--help") || !std::strcmp(argv[2], "-h")) ? 0 : 2;
  }
  std::fprintf(stderr, "nucleus: unknown command '%s'\n", cmd.c_str());
  usage(stderr);
  return 2;
}
