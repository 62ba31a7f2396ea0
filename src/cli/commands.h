// Subcommands of the nucleus binary; each parses its own flags.
#pragma once

namespace nucleus::cli {
int run_generate(int argc, char** argv);
}  // namespace nucleus::cli
