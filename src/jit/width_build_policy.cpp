#include "jit/width_build_policy.h"

#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>

#include "core/knobs.h"
#include "core/logging.h"

namespace nucleus::width {

const char* variant_name(BuildVariant v) {
  switch (v) {
    case BuildVariant::kFused: return "fused";
    case BuildVariant::kLean: return "lean";
    case BuildVariant::kPlain: return "plain";
  }
  return "?";
}

int max_blocks_per_sm(const KernelFigures& k, const DeviceLimits& d) {
  if (k.driver_max_blocks_per_sm >= 0) return k.driver_max_blocks_per_sm;
  if (k.threads_per_block <= 0 || k.num_regs > d.max_regs_per_thread) return 0;
  int limit = d.max_blocks_per_sm;
  // Registers: allocated per warp, rounded up to the allocation unit.
  const int warps = (k.threads_per_block + 31) / 32;
  const int64_t regs_per_warp = (static_cast<int64_t>(k.num_regs) * 32 + d.reg_alloc_unit - 1) /
                                d.reg_alloc_unit * d.reg_alloc_unit;
  if (regs_per_warp > 0) limit = std::min<int64_t>(limit, d.regs_per_sm / (regs_per_warp * warps));
  // Shared memory, with the per-CTA reservation.
  const int64_t smem = k.static_smem_bytes + k.dynamic_smem_bytes;
  if (smem > d.smem_per_block_max_bytes) return 0;
  limit = std::min<int64_t>(limit, d.smem_per_sm_bytes / (smem + d.smem_reserved_per_block_bytes));
  // Threads.
  limit = std::min(limit, d.threads_per_sm / k.threads_per_block);
  return std::max(limit, 0);
}

std::string describe(const KernelFigures& k, const DeviceLimits& d) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "%s: %d regs, %" PRId64 " B local, %" PRId64 "+%" PRId64 " B smem, %d threads x %" PRId64
                " CTAs, %d CTAs/SM x %d SMs",
                k.name.c_str(), k.num_regs, k.local_bytes, k.static_smem_bytes, k.dynamic_smem_bytes,
                k.threads_per_block, k.blocks_needed, max_blocks_per_sm(k, d), d.sm_count);
  return buf;
}

std::optional<std::string> refusal_reason(const KernelFigures& k, const DeviceLimits& d) {
  if (k.local_bytes > 0)
    return describe(k, d) + ": needs " + std::to_string(k.local_bytes) +
           " B of local memory a thread (register spills), a persistent kernel must not";
  const int per_sm = max_blocks_per_sm(k, d);
  if (per_sm == 0) return describe(k, d) + ": cannot launch (no CTA fits a multiprocessor)";
  if (k.persistent && k.blocks_needed > static_cast<int64_t>(per_sm) * d.sm_count)
    return describe(k, d) + ": grid not co-resident (" + std::to_string(k.blocks_needed) + " CTAs > " +
           std::to_string(static_cast<int64_t>(per_sm) * d.sm_count) + ")";
  return std::nullopt;
}

uint64_t hash_text(const std::string& text) { return XXH64(text.data(), text.size(), 0); }

std::string BuildKey::to_string() const {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "-src%016" PRIx64 "-opt%016" PRIx64, source_hash, options_hash);
  std::string s = kernel + "-w" + std::to_string(width) + "-" + variant_name(variant) + "-" + arch + "-" + compiler + buf;
  for (char& c : s)  // file-name safe
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) c = '_';
  return s;
}

std::string WidthChoice::log_line() const {
  std::string s = "width " + std::to_string(width) + ": " + variant_name(served);
  if (build) {
    s += " build " + build->key.to_string() + (build->from_cache ? " (cached)" : " (compiled)");
  }
  for (const std::string& r : refusals) s += "; refused: " + r;
  return s;
}

bool strict_widths_from_env() { return env_flag(Knob::kStrictWidths); }

const char* width_builds_mode_name(WidthBuildsMode m) {
  switch (m) {
    case WidthBuildsMode::kOff: return "0";
    case WidthBuildsMode::kOn: return "1";
    case WidthBuildsMode::kLeanOnly: return "lean";
  }
  return "?";
}

StatusOr<WidthBuildsMode> width_builds_mode_from_env() {
  const auto v = env_string(Knob::kWidthBuilds);
  if (!v || v->empty() || *v == "0") return WidthBuildsMode::kOff;
  if (*v == "1") return WidthBuildsMode::kOn;
  if (*v == "lean") return WidthBuildsMode::kLeanOnly;
  return invalid_argument("NUCLEUS_WIDTH_BUILDS='" + *v + "' is not one of 0, 1, lean");
}

namespace {

// Why `b` is refused (the first refused kernel), or nullopt.
std::optional<std::string> build_refusal(const WidthBuild& b, const DeviceLimits& d) {
  if (b.kernels.empty()) return std::string("build has no kernels");
  for (const KernelFigures& k : b.kernels)
    if (auto r = refusal_reason(k, d)) return std::string(variant_name(b.key.variant)) + " " + *r;
  return std::nullopt;
}

}  // namespace

StatusOr<std::vector<WidthChoice>> plan_widths(const std::vector<int64_t>& widths, WidthBuilder& builder,
                                               const WidthPlanOptions& options) {
  auto info = options.info ? options.info : [](const std::string& m) { NUCLEUS_LOG_INFO("{}", m); };
  auto warn = options.warn ? options.warn : [](const std::string& m) { NUCLEUS_LOG_WARN("{}", m); };
  std::vector<WidthChoice> out;
  for (int64_t w : widths) {
    WidthChoice choice;
    choice.width = w;
    for (BuildVariant v : {BuildVariant::kFused, BuildVariant::kLean}) {
      StatusOr<WidthBuild> b = builder.build(w, v);
      if (!b.ok()) {
        choice.refusals.push_back(std::string(variant_name(v)) + " build failed: " + b.status().message());
        continue;
      }
      if (auto r = build_refusal(*b, options.limits)) {
        choice.refusals.push_back(*r);
        continue;
      }
      choice.served = v;
      choice.build = std::move(*b);
      break;
    }
    if (choice.served == BuildVariant::kPlain) {
      std::string why;
      for (const std::string& r : choice.refusals) why += (why.empty() ? "" : "; ") + r;
      if (options.strict)
        return failed_precondition("width " + std::to_string(w) +
                                   " has no width build (NUCLEUS_STRICT_WIDTHS=1 refuses the plain path): " + why);
      warn("width " + std::to_string(w) + " runs the plain path: " + why);
    }
    info(choice.log_line());
    out.push_back(std::move(choice));
  }
  return out;
}

}  // namespace nucleus::width
