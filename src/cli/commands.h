// Subcommands of the nucleus binary; each parses its own flags.
#pragma once

namespace nucleus::cli {
int run_generate(int argc, char** argv);
int run_serve(int argc, char** argv);        // nucleus serve
int run_bench_serve(int argc, char** argv);  // nucleus bench serve
int run_bench_latency(int argc, char** argv);  // nucleus bench latency
}  // namespace nucleus::cli
