// nucleus: DeepSeek-family inference engine.
//   nucleus generate --model DIR [...]   offline batch generation
// Run `nucleus <command> --help` for a command's flags.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.h"

namespace {
void usage() {
  std::fprintf(stderr,
               "usage: nucleus <command> [flags]\n"
               "commands:\n"
               "  generate   offline batch generation (prompts in, text or JSON lines out)\n"
               "run 'nucleus <command> --help' for the command's flags\n");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  // The subcommand sees argv without the command word.
  if (cmd == "generate") return nucleus::cli::run_generate(argc - 1, argv + 1);
  std::fprintf(stderr, "nucleus: unknown command '%s'\n", cmd.c_str());
  usage();
  return 2;
}
