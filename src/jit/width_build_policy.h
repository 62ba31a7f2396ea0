// Width builds: the device-independent policy (design.md, "Width builds").
//
// Some decode kernels are compiled once per step width W (rows in a decode
// step, one per captured CUDA-graph size) with W a compile-time constant. A
// persistent kernel synchronises its CTAs with grid-wide barriers, so every
// CTA of its grid must be resident at once; a build that needs local memory
// (register spills) or whose grid cannot be co-resident is refused. For each
// width the planner asks for:
//   1. the fused build (one persistent kernel);
//   2. when that is refused, the lean build of the whole width (the same work
//      split into two kernels at the heaviest stage, smaller register tiles);
//   3. when that is refused too, nothing: the width runs the plain path (the
//      chain of ordinary kernels) and a warning names the width and the
//      reason; in strict mode (NUCLEUS_STRICT_WIDTHS=1) that is an error.
// A width whose fused build is accepted is never asked for a lean build.
// Nothing here touches a GPU: builds come from a WidthBuilder (NVRTC on CUDA,
// recorded figures in tests).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace nucleus::width {

// Which build serves a width.
enum class BuildVariant { kFused, kLean, kPlain };
const char* variant_name(BuildVariant v);  // "fused", "lean", "plain"

// What a multiprocessor offers (occupancy calculator inputs). Defaults are
// sm_90 (H100/H200); sm_count is the device's (132 on the H200).
struct DeviceLimits {
  int sm_count = 132;
  int regs_per_sm = 65536;             // 32-bit registers in the register file
  int reg_alloc_unit = 256;            // registers are allocated per warp in units of this
  int max_regs_per_thread = 255;
  int64_t smem_per_sm_bytes = 233472;  // 228 KiB
  int64_t smem_per_block_max_bytes = 232448;  // 227 KiB opt-in maximum of one CTA
  int64_t smem_reserved_per_block_bytes = 1024;  // the runtime's reservation per CTA (sm_8x/9x)
  int threads_per_sm = 2048;
  int max_blocks_per_sm = 32;
};

// Resource figures of one compiled kernel, as the driver reports them
// (CU_FUNC_ATTRIBUTE_NUM_REGS, _LOCAL_SIZE_BYTES, _SHARED_SIZE_BYTES) plus the
// launch the runner will make.
struct KernelFigures {
  std::string name;                // kernel symbol
  int num_regs = 0;                // registers per thread
  int64_t local_bytes = 0;         // local memory per thread (> 0: spills or stack)
  int64_t static_smem_bytes = 0;   // __shared__ declared in the kernel
  int64_t dynamic_smem_bytes = 0;  // requested at launch
  int threads_per_block = 0;
  int64_t blocks_needed = 0;       // grid size of the launch
  bool persistent = false;         // grid barriers: every CTA must be resident at once
  // The driver's answer (cuOccupancyMaxActiveBlocksPerMultiprocessor); -1:
  // not asked, use max_blocks_per_sm() below.
  int driver_max_blocks_per_sm = -1;
};

// CTAs of this kernel one multiprocessor holds at once: the minimum of the
// register, shared-memory, thread and CTA-count limits:
//   regs:    floor(regs_per_sm / (warps_per_cta * ceil(num_regs * 32 / unit) * unit))
//   smem:    floor(smem_per_sm / (static + dynamic + reserved))   (0 above the per-CTA maximum)
//   threads: floor(threads_per_sm / threads_per_block)
//   blocks:  max_blocks_per_sm
// Uses driver_max_blocks_per_sm when it is set. 0 means the kernel cannot
// launch at all.
int max_blocks_per_sm(const KernelFigures& k, const DeviceLimits& d);

// Why this kernel is refused, or nullopt when it is accepted: local memory
// > 0, or (persistent kernels) blocks_needed > max_blocks_per_sm * sm_count,
// or a kernel that cannot launch. The reason carries the figures.
std::optional<std::string> refusal_reason(const KernelFigures& k, const DeviceLimits& d);

// "name: R regs, L B local, S B smem (static+dynamic), T threads x B CTAs, M/SM"
std::string describe(const KernelFigures& k, const DeviceLimits& d);

// The cache key of one build: a lean build is never served for a fused one,
// nor a build of other source, width, target or compiler.
struct BuildKey {
  std::string kernel;         // kernel family, e.g. "mla_front"
  uint64_t source_hash = 0;   // XXH64 of the source text
  int64_t width = 0;
  BuildVariant variant = BuildVariant::kFused;
  std::string arch;           // "sm_90a"
  std::string compiler;       // e.g. "nvrtc-13.0"
  uint64_t options_hash = 0;  // XXH64 of every other compile option (e.g. -maxrregcount)

  // A file-name-safe string naming every field:
  // "<kernel>-w<W>-<variant>-<arch>-<compiler>-src<16 hex>-opt<16 hex>".
  std::string to_string() const;
};
uint64_t hash_text(const std::string& text);  // XXH64, seed 0

// One build of one width: its key and the figures of each of its kernels
// (one for fused, two for lean). `handle` is the builder's loaded binary
// (opaque here; null for recorded figures).
struct WidthBuild {
  BuildKey key;
  std::vector<KernelFigures> kernels;
  bool from_cache = false;
  std::shared_ptr<void> handle;
};

// Produces builds. build() returns the build with its figures, or an error
// Status when the build could not be made at all (a compile error, no NVRTC):
// the planner treats that as a refusal with the error as its reason.
class WidthBuilder {
 public:
  virtual ~WidthBuilder() = default;
  virtual StatusOr<WidthBuild> build(int64_t width, BuildVariant variant) = 0;
};

// Offers one variant of `inner` and refuses the other ("<variant> builds not
// asked for (<why>)"): NUCLEUS_WIDTH_BUILDS=lean (lean only) and tests that
// need one variant served.
class OnlyVariantBuilder : public WidthBuilder {
 public:
  OnlyVariantBuilder(WidthBuilder& inner, BuildVariant variant, std::string why)
      : inner_(inner), variant_(variant), why_(std::move(why)) {}
  StatusOr<WidthBuild> build(int64_t width, BuildVariant variant) override {
    if (variant != variant_)
      return unsupported(std::string(variant_name(variant)) + " builds not asked for (" + why_ + ")");
    return inner_.build(width, variant);
  }

 private:
  WidthBuilder& inner_;
  BuildVariant variant_;
  std::string why_;
};

// The decision for one width.
struct WidthChoice {
  int64_t width = 0;
  BuildVariant served = BuildVariant::kPlain;
  std::optional<WidthBuild> build;   // the serving build (absent for plain)
  std::vector<std::string> refusals; // why each refused build was refused, in order asked
  std::string log_line() const;      // "width 64: fused (...)" / "width 64: plain (fused refused: ...; lean refused: ...)"
};

struct WidthPlanOptions {
  DeviceLimits limits;
  bool strict = false;  // a width served by the plain path is an error
  // Where warnings and info lines go (default: NUCLEUS_LOG_WARN / _INFO).
  std::function<void(const std::string&)> warn;
  std::function<void(const std::string&)> info;
};

// Reads NUCLEUS_STRICT_WIDTHS (1, true, yes, on: set; anything else: not; env_flag rules).
bool strict_widths_from_env();

// Whether the decode graph runs the MLA front end through width builds
// (NUCLEUS_WIDTH_BUILDS): kOff ("0", unset: the separate ops), kOn ("1":
// fused, else lean, else the plain chain, per width), kLeanOnly ("lean": lean,
// else plain, never fused: measures the lean build where fused would serve).
enum class WidthBuildsMode { kOff, kOn, kLeanOnly };
const char* width_builds_mode_name(WidthBuildsMode m);  // "0", "1", "lean"
// Errors: a value other than 0, 1, lean (kInvalidArgument naming it).
StatusOr<WidthBuildsMode> width_builds_mode_from_env();

// Plans every width (each asked fused, then lean only if fused is refused).
// Logs one info line per width naming the build that serves it, and a warning
// for each width left to the plain path. Errors: in strict mode, the first
// width left to the plain path (kFailedPrecondition naming the width and every
// refusal); otherwise none (a refused build is a decision, not an error).
StatusOr<std::vector<WidthChoice>> plan_widths(const std::vector<int64_t>& widths, WidthBuilder& builder,
                                               const WidthPlanOptions& options);

}  // namespace nucleus::width
