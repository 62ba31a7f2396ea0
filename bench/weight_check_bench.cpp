// The load-time weight check (model/weight_check.h): its time on the shipped
// tiny checkpoints (the mmap'd shards as the loader sees them: the first pass
// also takes the page faults, later passes read warm pages), and its rate on
// large in-memory tensors per dtype against a plain read of the same bytes
// (a 64-bit sum: the host's read bandwidth at this thread count, the
// check's roofline).
//   weight_check_bench [MODELS_DIR] [--mib N]   (default: the repository's models/, 1024 MiB)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/logging.h"
#include "core/parallel.h"
#include "core/tensor.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/weight_check.h"
#include "model/weights.h"

using namespace nucleus;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds to check every tensor of `ckpt` once.
double check_checkpoint(const Checkpoint& ckpt, int64_t* bytes) {
  const double t0 = now();
  *bytes = 0;
  for (const auto& [name, e] : ckpt.entries()) {
    const ValueCheck check =
        name.find("weight_scale_inv") != std::string::npos ? ValueCheck::kBlockScale : ValueCheck::kFinite;
    if (first_bad_value(e.data, e.dtype, shape_numel(e.shape), check) >= 0)
      std::fprintf(stderr, "%s: bad value\n", name.c_str());
    *bytes += static_cast<int64_t>(e.nbytes);
  }
  return now() - t0;
}

// Seconds of load_weights (CPU backend) of the checkpoint in `dir`, opened
// afresh (its pages mapped anew), with or without the value check.
double load_seconds(const std::string& dir, bool check_values) {
  auto config = load_model_config(dir + "/config.json");
  auto ckpt = Checkpoint::open(dir);
  if (!config.ok() || !ckpt.ok()) return -1;
  auto backend = make_cpu_weight_backend();
  LoadOptions lo;
  lo.show_progress = false;
  lo.check_values = check_values;
  const double t0 = now();
  auto w = load_weights(*ckpt, *config, *backend, lo);
  return w.ok() ? now() - t0 : -1;
}

// A parallel 64-bit sum of `bytes` bytes: the read rate the check can reach.
double read_seconds(const std::vector<uint64_t>& words) {
  std::vector<uint64_t> partial(static_cast<size_t>(cpu_threads()) * 8, 0);
  const double t0 = now();
  parallel_for(static_cast<int64_t>(words.size()), int64_t{1} << 17, [&](int64_t b, int64_t e) {
    uint64_t s = 0;
    for (int64_t i = b; i < e; ++i) s += words[i];
    partial[static_cast<size_t>(b * cpu_threads() / static_cast<int64_t>(words.size())) * 8] += s;
  });
  const double t = now() - t0;
  uint64_t total = 0;
  for (uint64_t p : partial) total += p;
  if (total == 42) std::printf(" ");  // keeps the sum live
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  std::string models = std::string(NUCLEUS_SOURCE_DIR) + "/models";
  int64_t mib = 1024;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--mib" && i + 1 < argc) mib = std::stoll(argv[++i]);
    else models = argv[i];
  }
  spdlog::set_level(spdlog::level::warn);  // not load_weights' own "weight check" lines
  std::printf("threads: %d\n", cpu_threads());
  for (const char* name : {"tiny-dsv3", "tiny-dsv3-fp8"}) {
    auto ckpt = Checkpoint::open(models + "/" + name);
    if (!ckpt.ok()) {
      std::fprintf(stderr, "%s\n", ckpt.status().to_string().c_str());
      return 1;
    }
    int64_t bytes = 0;
    const double first = check_checkpoint(*ckpt, &bytes);
    std::vector<double> warm;
    for (int r = 0; r < 9; ++r) warm.push_back(check_checkpoint(*ckpt, &bytes));
    const double w = median(warm);
    std::printf("%-14s %6.1f MiB  first pass %7.2f ms (%5.2f GB/s)  warm %6.2f ms (%5.2f GB/s)\n", name,
                bytes / double(1 << 20), 1e3 * first, bytes / first / 1e9, 1e3 * w, bytes / w / 1e9);
    std::vector<double> on, off;  // alternated, so drift in the host's load hits both alike
    for (int r = 0; r < 7; ++r) {
      on.push_back(load_seconds(models + "/" + name, true));
      off.push_back(load_seconds(models + "/" + name, false));
    }
    std::printf("%-14s load_weights (CPU backend, median of 7): %.1f ms checked, %.1f ms with --skip-weight-check\n",
                name, 1e3 * median(on), 1e3 * median(off));
  }
  const int64_t bytes = mib << 20;
  std::vector<uint64_t> words(static_cast<size_t>(bytes / 8));
  for (size_t i = 0; i < words.size(); ++i) words[i] = 0x3f003f003f003f00ull ^ (i & 0x003f003f);  // finite, > 0
  std::vector<double> reads;
  for (int r = 0; r < 5; ++r) reads.push_back(read_seconds(words));
  const double read = median(reads);
  std::printf("%lld MiB in memory: plain read %.2f GB/s\n", static_cast<long long>(mib), bytes / read / 1e9);
  struct Case {
    const char* label;
    DType dtype;
    ValueCheck check;
  };
  for (const Case& c : {Case{"BF16 finite", DType::kBF16, ValueCheck::kFinite},
                        Case{"F32 finite", DType::kF32, ValueCheck::kFinite},
                        Case{"F8_E4M3 NaN bytes", DType::kF8E4M3, ValueCheck::kFinite},
                        Case{"F32 block scale", DType::kF32, ValueCheck::kBlockScale}}) {
    std::vector<double> t;
    for (int r = 0; r < 5; ++r) {
      const double t0 = now();
      const int64_t bad = first_bad_value(words.data(), c.dtype, bytes / static_cast<int64_t>(dtype_size(c.dtype)),
                                          c.check);
      t.push_back(now() - t0);
      if (bad >= 0) std::fprintf(stderr, "%s: unexpected bad value at %lld\n", c.label, static_cast<long long>(bad));
    }
    const double s = median(t);
    std::printf("  %-18s %6.2f GB/s (%3.0f%% of the plain read)\n", c.label, bytes / s / 1e9, 100 * read / s);
  }
  return 0;
}
