// Width builds of the MLA decode front end (jit/mla_front_kernel.cuh):
// per decode-graph width W the fused kernel compiled through NVRTC with W
// fixed, refused when it spills or cannot be co-resident, then the lean build,
// then the plain chain of existing kernels (policy: width_build_policy.h).
// CUDA builds only. Switches (docs/width_builds.md, docs/flags.md):
//   NUCLEUS_STRICT_WIDTHS=1              a width left to the plain path is an error
//   NUCLEUS_KERNEL_CACHE_DIR=DIR         where builds are cached (empty: no cache)
//   NUCLEUS_WIDTH_MAXRREGCOUNT=N         debug: cap the fused build's registers a thread
//   NUCLEUS_WIDTH_MAXRREGCOUNT_LEAN=N    debug: cap the lean build's registers a thread
#pragma once

#ifdef NUCLEUS_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "jit/kernel_cache.h"
#include "jit/mla_front_params.h"
#include "jit/width_build_policy.h"

namespace nucleus::width {

constexpr int kMlaFrontThreads = 256;
constexpr int kMlaFrontLeanRows = 8;  // NUCLEUS_LEAN_ROWS of the lean build

// Dynamic shared memory of the kernel that runs stage D: tile * 128 bf16,
// tile = W (fused) or min(W, kMlaFrontLeanRows) (lean).
int64_t mla_front_dynamic_smem_bytes(int64_t width, BuildVariant variant);

struct MlaFrontBuildOptions {
  std::string arch = "sm_90a";
  int fused_max_regs = 0;  // > 0: -DNUCLEUS_MAX_REGS for fused builds
  int lean_max_regs = 0;   // > 0: the same for lean builds
  std::string cache_dir;   // empty: no cache
  int sm_count = 0;        // CTAs a persistent launch uses (one per SM)
  // Cooperative launches of the persistent kernels (NUCLEUS_WIDTH_COOPERATIVE,
  // default 1): the driver guarantees co-residency or refuses the launch.
  bool cooperative = true;
  // From the environment and the current device. Errors: a malformed
  // NUCLEUS_WIDTH_MAXRREGCOUNT{,_LEAN} (not an integer in 16..255).
  static StatusOr<MlaFrontBuildOptions> from_env();
  // Errors also: NUCLEUS_WIDTH_COOPERATIVE other than 0 or 1.
  // The same without asking a device (sm_count 0): for compiling only.
  static StatusOr<MlaFrontBuildOptions> compile_options_from_env();
};

// Compiles (or loads from the cache) and loads one build, reading its
// figures from the driver. Thread-compatible.
class MlaFrontBuilder : public WidthBuilder {
 public:
  explicit MlaFrontBuilder(MlaFrontBuildOptions options);
  StatusOr<WidthBuild> build(int64_t width, BuildVariant variant) override;
  BuildKey key_for(int64_t width, BuildVariant variant) const;  // errors aside, NVRTC's version in it
  // Compiles the build into the cache without loading it (no GPU needed:
  // `nucleus prebuild-kernels`); a build already cached is left alone.
  // Returns true when it compiled. The entry's figures are names only: a
  // load re-reads them from the driver. Errors: no cache directory, NVRTC
  // missing, a compile error, an unwritable cache. Thread-safe.
  StatusOr<bool> prebuild(int64_t width, BuildVariant variant) const;
  int compiles() const { return compiles_; }  // NVRTC compilations run (cache misses)
  const KernelCache& cache() const { return cache_; }

 private:
  MlaFrontBuildOptions options_;
  KernelCache cache_;
  std::atomic<int> compiles_{0};
};

// One prebuild of prebuild_widths().
struct PrebuildResult {
  int64_t width = 0;
  BuildVariant variant = BuildVariant::kFused;
  Status status;         // OK, or why it could not be built
  bool compiled = false; // false: it was in the cache already
  double seconds = 0;    // wall time of this build
};

// builder.prebuild() of every (width, variant) on `jobs` threads, widest
// first (the slowest compiles start first); on_done (may be empty) is called
// for each under a lock as it finishes. Returns the results in that order.
std::vector<PrebuildResult> prebuild_widths(const MlaFrontBuilder& builder, const std::vector<int64_t>& widths,
                                            const std::vector<BuildVariant>& variants, int jobs,
                                            const std::function<void(const PrebuildResult&)>& on_done = {});

// The widths' plan and their loaded builds; launches the serving build.
class MlaFrontWidthBuilds {
 public:
  // Plans `widths` (ascending) with `builder`. Errors: strict mode with a
  // width left to the plain path (plan_widths).
  // `cooperative`: launch the builds cooperatively (MlaFrontBuildOptions).
  static StatusOr<std::unique_ptr<MlaFrontWidthBuilds>> create(const std::vector<int64_t>& widths,
                                                               WidthBuilder& builder, const WidthPlanOptions& options,
                                                               int sm_count, bool cooperative = true);
  const std::vector<WidthChoice>& choices() const { return choices_; }
  // The choice for a step of `rows` rows: the smallest planned width >= rows
  // (null: wider than every width).
  const WidthChoice* choice_for(int64_t rows) const;
  // Runs the front end for p.rows rows with the build serving them.
  // kUnsupported when the plain path serves them (run launch_mla_front_plain).
  // Stream-async and capturable; p.barrier must be zero before the first
  // launch and not be shared with a launch on another stream.
  Status launch(const MlaFrontParams& p, cudaStream_t stream) const;
  // Launches of a build so far (eager calls of launch() that ran a build;
  // graph replays are not counted): tests check that a build, not the plain
  // chain, served a step.
  int64_t launches() const { return launches_.load(); }

 private:
  std::vector<WidthChoice> choices_;
  int sm_count_ = 0;
  bool cooperative_ = true;
  mutable std::atomic<int64_t> launches_{0};
};

// The start-up plan of the width builds for the decode graph sizes `widths`
// (ascending): build options from the switches (a cache directory that is
// not writable is dropped with a warning), on a cold cache the first builds
// compiled in parallel (one job a hardware thread) into the cache, then
// MlaFrontWidthBuilds::create over every width (kLeanOnly: lean builds
// only), logged once by rank 0. Tensor-parallel ranks plan one after another
// (the first compiles, the others load from the cache). Errors: a malformed
// register-cap switch, strict mode with a width left to the plain path.
StatusOr<std::unique_ptr<MlaFrontWidthBuilds>> plan_mla_front_builds(const std::vector<int64_t>& widths,
                                                                     WidthBuildsMode mode, bool strict, int rank);

// The plain path: the existing kernels in the decode graph's order (cuBLASLt
// q_a / kv_a / q_b, RMSNorm in place, RoPE + cache write, gather + cuBLASLt
// absorption). q_nope_c: scratch [p.rows, num_heads, 128] bf16. Ignores
// p.barrier. Stream-async; the first call of a shape must be outside a
// capture (cuBLASLt plans).
Status launch_mla_front_plain(const MlaFrontParams& p, void* q_nope_c, cudaStream_t stream);

}  // namespace nucleus::width

#endif  // NUCLEUS_HAVE_CUDA
