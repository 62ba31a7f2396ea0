// nucleus prebuild-kernels: compiles the decode width builds (the MLA front
// end's fused and lean builds, docs/width_builds.md) for a set of widths into
// the kernel cache with NVRTC, without a GPU, so that a server started with
// NUCLEUS_WIDTH_BUILDS=1 loads every width instead of compiling it (the wide
// fused builds take minutes cold). Builds run in parallel, widest first; a
// build already in the cache is skipped. The runtime re-reads each build's
// figures from the driver and applies the policy (spills, co-residency) then.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "cli/commands.h"
#include "jit/width_build_policy.h"
#include "runtime/model_executor.h"
#ifdef NUCLEUS_HAVE_CUDA
#include "jit/mla_front_builds.h"
#endif

namespace nucleus::cli {

int run_prebuild_kernels(int argc, char** argv) {
  CLI::App app{"nucleus prebuild-kernels: compile the decode width builds into the kernel cache (no GPU needed)"};
  std::vector<int64_t> sizes;
  int64_t max_num_seqs = 256;
  std::string cache_dir;
  std::vector<std::string> variants = {"fused", "lean"};
  int jobs = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("--cuda-graph-sizes", sizes,
                 "widths to build (default: the decode graph sizes of --max-num-seqs, as nucleus serve uses)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{8192}));
  app.add_option("--max-num-seqs", max_num_seqs, "the engine's --max-num-seqs (default 256)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--cache-dir", cache_dir, "kernel cache directory (default: NUCLEUS_KERNEL_CACHE_DIR's rules)");
  app.add_option("--variants", variants, "builds to make: fused, lean (default both)")
      ->delimiter(',')
      ->check(CLI::IsMember({"fused", "lean"}));
  app.add_option("-j,--jobs", jobs, "parallel compiles (default: hardware threads)")->check(CLI::Range(1, 1024));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return exit_code_for(app, e);
  }
#ifndef NUCLEUS_HAVE_CUDA
  std::fprintf(stderr, "nucleus prebuild-kernels: this build has no CUDA support (configure with -DNUCLEUS_CUDA=ON)\n");
  return 1;
#else
  auto options = width::MlaFrontBuildOptions::compile_options_from_env();
  if (!options.ok()) {
    std::fprintf(stderr, "nucleus prebuild-kernels: %s\n", options.status().message().c_str());
    return 2;
  }
  if (app.count("--cache-dir")) {
    if (cache_dir.empty()) {
      std::fprintf(stderr, "nucleus prebuild-kernels: --cache-dir is empty\n");
      return 2;
    }
    options->cache_dir = cache_dir;
  }
  if (options->cache_dir.empty()) {
    std::fprintf(stderr, "nucleus prebuild-kernels: no cache directory (pass --cache-dir or set NUCLEUS_KERNEL_CACHE_DIR)\n");
    return 2;
  }
  if (Status w = width::KernelCache(options->cache_dir).check_writable(); !w.ok()) {
    std::fprintf(stderr, "nucleus prebuild-kernels: %s\n", w.message().c_str());
    return 2;
  }
  if (sizes.empty()) sizes = default_cuda_graph_sizes(max_num_seqs);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  std::vector<width::BuildVariant> vs;
  for (const char* name : {"fused", "lean"})  // each once, whatever the flag repeats
    if (std::find(variants.begin(), variants.end(), name) != variants.end())
      vs.push_back(std::string(name) == "fused" ? width::BuildVariant::kFused : width::BuildVariant::kLean);
  const width::MlaFrontBuilder builder(*options);
  std::printf("nucleus prebuild-kernels: %zu builds of %zu widths into %s, %d jobs\n", sizes.size() * vs.size(),
              sizes.size(), options->cache_dir.c_str(), jobs);
  std::fflush(stdout);
  int compiled = 0, cached = 0, failed = 0;
  const auto t0 = std::chrono::steady_clock::now();
  width::prebuild_widths(builder, sizes, vs, jobs, [&](const width::PrebuildResult& r) {
    const auto w = static_cast<long long>(r.width);
    if (!r.status.ok()) {
      ++failed;
      std::printf("width %lld %s: failed: %s\n", w, width::variant_name(r.variant), r.status.message().c_str());
    } else if (r.compiled) {
      ++compiled;
      std::printf("width %lld %s: compiled in %.1f s\n", w, width::variant_name(r.variant), r.seconds);
    } else {
      ++cached;
      std::printf("width %lld %s: already cached\n", w, width::variant_name(r.variant));
    }
    std::fflush(stdout);
  });
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%d compiled, %d already cached, %d failed in %.1f s\n", compiled, cached, failed, total);
  return failed > 0 ? 1 : 0;
#endif
}

}  // namespace nucleus::cli
