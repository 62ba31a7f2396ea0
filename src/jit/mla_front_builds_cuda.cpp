#include "jit/mla_front_builds.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "core/knobs.h"
#include "core/logging.h"
#include "kernels/gemm/gemm_cublaslt.h"
#include "kernels/mla/mla_decode.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "kernels/rope/rope_kv_cache.cuh"
#include "jit/nvrtc_compile.h"

namespace nucleus {
namespace embedded {
extern const char kMlaFrontKernelSource[];
extern const char kMlaFrontParamsSource[];
}  // namespace embedded

namespace width {
namespace {

// The kernels of a build, in launch order.
std::vector<std::string> kernel_names(BuildVariant v) {
  if (v == BuildVariant::kFused) return {"mla_front_fused"};
  return {"mla_front_lean_a", "mla_front_lean_b"};
}

StatusOr<int> reg_cap_from_env(Knob knob) {
  auto v = env_string(knob);
  if (!v || v->empty()) return 0;
  char* end = nullptr;
  const long n = std::strtol(v->c_str(), &end, 10);
  if (*end != '\0' || n < 16 || n > 255)
    return invalid_argument(std::string(knob_name(knob)) + "='" + *v + "': expected registers a thread, 16..255");
  return static_cast<int>(n);
}

// A loaded build: the module and each kernel's launch shape.
struct Loaded {
  std::unique_ptr<LoadedModule> module;
  std::vector<int64_t> dynamic_smem_bytes;
};

}  // namespace

int64_t mla_front_dynamic_smem_bytes(int64_t width, BuildVariant variant) {
  const int64_t tile = variant == BuildVariant::kFused ? width : std::min<int64_t>(width, kMlaFrontLeanRows);
  return tile * 128 * 2;
}

StatusOr<MlaFrontBuildOptions> MlaFrontBuildOptions::compile_options_from_env() {
  MlaFrontBuildOptions o;
  NUCLEUS_ASSIGN_OR_RETURN(o.fused_max_regs, reg_cap_from_env(Knob::kWidthMaxrregcount));
  NUCLEUS_ASSIGN_OR_RETURN(o.lean_max_regs, reg_cap_from_env(Knob::kWidthMaxrregcountLean));
  o.cache_dir = KernelCache::dir_from_env();
  if (auto v = env_string(Knob::kWidthCooperative); v && *v != "1") {
    if (*v != "0") return invalid_argument("NUCLEUS_WIDTH_COOPERATIVE='" + *v + "' is not 0 or 1");
    o.cooperative = false;
  }
  return o;
}

StatusOr<MlaFrontBuildOptions> MlaFrontBuildOptions::from_env() {
  NUCLEUS_ASSIGN_OR_RETURN(MlaFrontBuildOptions o, compile_options_from_env());
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return unsupported("width builds: no CUDA device");
  o.sm_count = sms;
  return o;
}

MlaFrontBuilder::MlaFrontBuilder(MlaFrontBuildOptions options)
    : options_(std::move(options)), cache_(options_.cache_dir) {}

namespace {

std::vector<std::string> compile_options(const MlaFrontBuildOptions& o, int64_t width, BuildVariant v) {
  std::vector<std::string> opts = {"-arch=" + o.arch, "-std=c++17", "-DNUCLEUS_WIDTH=" + std::to_string(width),
                                   "-DNUCLEUS_LEAN=" + std::string(v == BuildVariant::kLean ? "1" : "0"),
                                   "-DNUCLEUS_LEAN_ROWS=" + std::to_string(kMlaFrontLeanRows)};
  const int cap = v == BuildVariant::kFused ? o.fused_max_regs : o.lean_max_regs;
  if (cap > 0) opts.push_back("-DNUCLEUS_MAX_REGS=" + std::to_string(cap));
  return opts;
}

}  // namespace

BuildKey MlaFrontBuilder::key_for(int64_t width, BuildVariant variant) const {
  BuildKey k;
  k.kernel = "mla_front";
  k.source_hash = hash_text(std::string(embedded::kMlaFrontParamsSource) + "\n//--\n" + embedded::kMlaFrontKernelSource);
  k.width = width;
  k.variant = variant;
  k.arch = options_.arch;
  auto version = nvrtc_version();
  k.compiler = version.ok() ? *version : "none";
  std::string all;
  for (const std::string& o : compile_options(options_, width, variant)) all += o + "\n";
  k.options_hash = hash_text(all);
  return k;
}

StatusOr<WidthBuild> MlaFrontBuilder::build(int64_t width, BuildVariant variant) {
  if (variant == BuildVariant::kPlain) return invalid_argument("the plain path is not a build");
  if (width < 1) return invalid_argument("width builds: width " + std::to_string(width) + " < 1");
  NUCLEUS_RETURN_IF_ERROR(nvrtc_version().status());
  WidthBuild b;
  b.key = key_for(width, variant);
  std::vector<char> cubin;
  if (auto hit = cache_.load(b.key)) {
    cubin = std::move(hit->binary);
    b.from_cache = true;
  } else {
    NUCLEUS_ASSIGN_OR_RETURN(
        cubin, nvrtc_compile_cubin(embedded::kMlaFrontKernelSource, "mla_front_kernel.cuh",
                                   {{"mla_front_params.h", embedded::kMlaFrontParamsSource}},
                                   compile_options(options_, width, variant)));
    ++compiles_;
  }
  const std::vector<std::string> names = kernel_names(variant);
  auto loaded = std::make_shared<Loaded>();
  NUCLEUS_ASSIGN_OR_RETURN(loaded->module, LoadedModule::load(cubin, names));
  for (size_t i = 0; i < names.size(); ++i) {
    NUCLEUS_ASSIGN_OR_RETURN(LoadedModule::Attributes a, loaded->module->attributes(static_cast<int>(i)));
    KernelFigures k;
    k.name = names[i];
    k.num_regs = a.num_regs;
    k.local_bytes = a.local_bytes;
    k.static_smem_bytes = a.static_smem_bytes;
    // Stage D runs in the fused kernel and in the lean build's second kernel.
    k.dynamic_smem_bytes = (variant == BuildVariant::kLean && i == 0) ? 0 : mla_front_dynamic_smem_bytes(width, variant);
    k.threads_per_block = kMlaFrontThreads;
    k.blocks_needed = options_.sm_count;
    k.persistent = true;
    NUCLEUS_ASSIGN_OR_RETURN(k.driver_max_blocks_per_sm,
                             loaded->module->max_active_blocks_per_sm(static_cast<int>(i), kMlaFrontThreads,
                                                                      k.dynamic_smem_bytes));
    loaded->dynamic_smem_bytes.push_back(k.dynamic_smem_bytes);
    b.kernels.push_back(k);
  }
  if (!b.from_cache) {
    Status s = cache_.store(b.key, CachedBuild{b.kernels, cubin});
    if (!s.ok()) NUCLEUS_LOG_WARN("{} (the build is used, not cached)", s.message());
  }
  b.handle = loaded;
  return b;
}

StatusOr<bool> MlaFrontBuilder::prebuild(int64_t width, BuildVariant variant) const {
  if (variant == BuildVariant::kPlain) return invalid_argument("the plain path is not a build");
  if (width < 1) return invalid_argument("width builds: width " + std::to_string(width) + " < 1");
  if (!cache_.enabled()) return invalid_argument("prebuilding kernels needs a cache directory");
  NUCLEUS_RETURN_IF_ERROR(nvrtc_version().status());
  const BuildKey key = key_for(width, variant);
  if (cache_.load(key)) return false;
  NUCLEUS_ASSIGN_OR_RETURN(std::vector<char> cubin,
                           nvrtc_compile_cubin(embedded::kMlaFrontKernelSource, "mla_front_kernel.cuh",
                                               {{"mla_front_params.h", embedded::kMlaFrontParamsSource}},
                                               compile_options(options_, width, variant)));
  CachedBuild entry;
  for (const std::string& name : kernel_names(variant)) {
    KernelFigures k;
    k.name = name;
    entry.kernels.push_back(k);
  }
  entry.binary = std::move(cubin);
  NUCLEUS_RETURN_IF_ERROR(cache_.store(key, entry));
  return true;
}

std::vector<PrebuildResult> prebuild_widths(const MlaFrontBuilder& builder, const std::vector<int64_t>& widths,
                                            const std::vector<BuildVariant>& variants, int jobs,
                                            const std::function<void(const PrebuildResult&)>& on_done) {
  std::vector<int64_t> sorted = widths;
  std::sort(sorted.rbegin(), sorted.rend());
  std::vector<PrebuildResult> results;  // one a (width, variant), filled in by the threads
  for (int64_t w : sorted)
    for (BuildVariant v : variants) {
      PrebuildResult r;
      r.width = w;
      r.variant = v;
      results.push_back(r);
    }
  std::atomic<size_t> next{0};
  std::mutex done;
  auto work = [&] {
    for (size_t i = next++; i < results.size(); i = next++) {
      PrebuildResult& r = results[i];
      const auto t0 = std::chrono::steady_clock::now();
      StatusOr<bool> b = builder.prebuild(r.width, r.variant);
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      r.status = b.status();
      r.compiled = b.ok() && *b;
      if (on_done) {
        std::lock_guard<std::mutex> lock(done);
        on_done(r);
      }
    }
  };
  std::vector<std::thread> threads;
  const int n = std::max(1, std::min<int>(jobs, static_cast<int>(results.size())));
  for (int t = 0; t < n; ++t) threads.emplace_back(work);
  for (auto& t : threads) t.join();
  return results;
}

StatusOr<std::unique_ptr<MlaFrontWidthBuilds>> MlaFrontWidthBuilds::create(const std::vector<int64_t>& widths,
                                                                           WidthBuilder& builder,
                                                                           const WidthPlanOptions& options,
                                                                           int sm_count, bool cooperative) {
  NUCLEUS_ASSIGN_OR_RETURN(std::vector<WidthChoice> choices, plan_widths(widths, builder, options));
  auto out = std::unique_ptr<MlaFrontWidthBuilds>(new MlaFrontWidthBuilds());
  out->choices_ = std::move(choices);
  std::sort(out->choices_.begin(), out->choices_.end(),
            [](const WidthChoice& a, const WidthChoice& b) { return a.width < b.width; });
  out->sm_count_ = sm_count;
  out->cooperative_ = cooperative;
  return out;
}

const WidthChoice* MlaFrontWidthBuilds::choice_for(int64_t rows) const {
  for (const WidthChoice& c : choices_)
    if (c.width >= rows) return &c;
  return nullptr;
}

Status MlaFrontWidthBuilds::launch(const MlaFrontParams& p, cudaStream_t stream) const {
  const WidthChoice* c = choice_for(p.rows);
  if (!c || c->served == BuildVariant::kPlain || !c->build)
    return unsupported("width builds: " + std::to_string(p.rows) + " rows run the plain path");
  if (p.rows == 0) return ok_status();
  const auto* loaded = static_cast<const Loaded*>(c->build->handle.get());
  if (!loaded) return internal_error("width build of width " + std::to_string(c->width) + " has no binary");
  MlaFrontParams arg = p;
  // Cooperative unless NUCLEUS_WIDTH_COOPERATIVE=0 (the kernels' grid barriers need every CTA resident).
  for (size_t i = 0; i < loaded->dynamic_smem_bytes.size(); ++i)
    NUCLEUS_RETURN_IF_ERROR(loaded->module->launch(static_cast<int>(i), static_cast<unsigned>(sm_count_),
                                                   kMlaFrontThreads, loaded->dynamic_smem_bytes[i], &arg, stream,
                                                   cooperative_));
  ++launches_;
  return ok_status();
}

Status launch_mla_front_plain(const MlaFrontParams& p, void* q_nope_c, cudaStream_t stream) {
  if (p.rows == 0) return ok_status();
  constexpr int kLora = 512, kRope = 64, kLatent = 576, kQkHead = 192;
  auto gemm = [&](const void* x, int64_t x_stride, const void* w, void* out, int64_t n, int64_t k) {
    kernels::GemmArgs g;
    g.x = x;
    g.x_stride = x_stride;
    g.w = w;
    g.out = out;
    g.out_stride = n;
    g.out_dtype = DType::kBF16;
    g.m = p.rows;
    g.n = n;
    g.k = k;
    return kernels::gemm_bf16_cublaslt(g, stream);
  };
  auto cuda = [](cudaError_t e, const char* what) {
    return e == cudaSuccess ? ok_status() : internal_error(std::string(what) + ": " + cudaGetErrorString(e));
  };
  auto* q_a = reinterpret_cast<__nv_bfloat16*>(p.q_a);
  auto* kv_a = reinterpret_cast<__nv_bfloat16*>(p.kv_a);
  auto* q = reinterpret_cast<__nv_bfloat16*>(p.q);
  const int64_t q_width = static_cast<int64_t>(p.num_heads) * kQkHead;
  if (p.q_lora > 0) {
    NUCLEUS_RETURN_IF_ERROR(gemm(p.x, p.x_stride, p.w_qa, q_a, p.q_lora, p.hidden));
    NUCLEUS_RETURN_IF_ERROR(cuda(
        kernels::launch_rmsnorm_inplace(q_a, p.q_lora, p.qa_norm_w, p.rows, p.q_lora, p.eps, stream), "q_a norm"));
    NUCLEUS_RETURN_IF_ERROR(gemm(q_a, p.q_lora, p.w_qb, q, q_width, p.q_lora));
  } else {  // q_proj
    NUCLEUS_RETURN_IF_ERROR(gemm(p.x, p.x_stride, p.w_qb, q, q_width, p.hidden));
  }
  NUCLEUS_RETURN_IF_ERROR(gemm(p.x, p.x_stride, p.w_kva, kv_a, kLatent, p.hidden));
  NUCLEUS_RETURN_IF_ERROR(
      cuda(kernels::launch_rmsnorm_inplace(kv_a, kLatent, p.kva_norm_w, p.rows, kLora, p.eps, stream), "kv_a norm"));
  kernels::RopeKvCacheParams r;
  r.q = q;
  r.q_stride = q_width;
  r.kv_a = kv_a;
  r.kv_stride = kLatent;
  r.positions = p.positions;
  r.slot_mapping = reinterpret_cast<const int64_t*>(p.slot_mapping);
  r.inv_freq = p.inv_freq;
  r.attention_factor = p.attention_factor;
  r.cache = p.cache;
  r.num_tokens = p.rows;
  r.num_heads = p.num_heads;
  r.qk_nope = 128;
  r.qk_rope = kRope;
  r.kv_lora = kLora;
  NUCLEUS_RETURN_IF_ERROR(cuda(kernels::launch_rope_kv_cache_write(r, stream), "rope + cache write"));
  kernels::MlaDecodeRows rows;
  rows.num_rows = p.rows;
  auto* q_full = reinterpret_cast<__nv_bfloat16*>(p.q_full);
  auto* nope = static_cast<__nv_bfloat16*>(q_nope_c);
  NUCLEUS_RETURN_IF_ERROR(
      cuda(kernels::launch_mla_decode_gather_q(rows, q, q_width, p.num_heads, nope, q_full, stream), "gather q"));
  const int st = kernels::mla_decode_gemm_absorb(reinterpret_cast<const __nv_bfloat16*>(p.w_kvb), p.num_heads, p.rows,
                                                 nope, q_full, stream);
  if (st != 0) return internal_error("absorption GEMM: cuBLAS status " + std::to_string(st));
  return ok_status();
}


StatusOr<std::unique_ptr<MlaFrontWidthBuilds>> plan_mla_front_builds(const std::vector<int64_t>& widths,
                                                                     WidthBuildsMode mode, bool strict, int rank) {
  NUCLEUS_ASSIGN_OR_RETURN(MlaFrontBuildOptions bo, MlaFrontBuildOptions::from_env());
  if (!bo.cache_dir.empty()) {
    if (Status w = KernelCache(bo.cache_dir).check_writable(); !w.ok()) {
      NUCLEUS_LOG_WARN("{}; width builds are compiled without a cache (set NUCLEUS_KERNEL_CACHE_DIR)", w.message());
      bo.cache_dir.clear();
    }
  }
  MlaFrontBuilder builder(bo);
  OnlyVariantBuilder lean_only(builder, BuildVariant::kLean, "NUCLEUS_WIDTH_BUILDS=lean");
  WidthPlanOptions po;
  po.strict = strict;
  // Tensor-parallel ranks plan one after another: the first compiles (in
  // parallel, below), the others then load every build from the cache.
  static std::mutex plan_mutex;
  std::lock_guard<std::mutex> plan_lock(plan_mutex);
  const auto t0 = std::chrono::steady_clock::now();
  // A cold cache: the first builds the plan asks for, compiled in parallel
  // (one job per hardware thread) into the cache; the plan then loads them
  // and compiles lean rebuilds where it must (small).
  int prebuilt = 0;
  if (!bo.cache_dir.empty()) {
    const BuildVariant first = mode == WidthBuildsMode::kLeanOnly ? BuildVariant::kLean : BuildVariant::kFused;
    const int jobs = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (const PrebuildResult& r : prebuild_widths(builder, widths, {first}, jobs)) {
      prebuilt += r.compiled ? 1 : 0;
      if (!r.status.ok())  // the plan compiles it again and records the refusal
        NUCLEUS_LOG_DEBUG("width {} {} prebuild: {}", r.width, variant_name(r.variant), r.status.message());
    }
  }
  NUCLEUS_ASSIGN_OR_RETURN(
      std::unique_ptr<MlaFrontWidthBuilds> builds,
      MlaFrontWidthBuilds::create(widths,
                                  mode == WidthBuildsMode::kLeanOnly ? static_cast<WidthBuilder&>(lean_only)
                                                                     : static_cast<WidthBuilder&>(builder),
                                  po, bo.sm_count, bo.cooperative));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int fused = 0, lean = 0, plain = 0;
  for (const WidthChoice& ch : builds->choices())
    (ch.served == BuildVariant::kFused ? fused : ch.served == BuildVariant::kLean ? lean : plain)++;
  if (rank == 0)
    NUCLEUS_LOG_INFO("width builds: {} widths ({} fused, {} lean, {} plain) ready in {:.2f} s, {} NVRTC compiles "
                     "(cache {})",
                     builds->choices().size(), fused, lean, plain, secs, prebuilt + builder.compiles(),
                     bo.cache_dir.empty() ? std::string("off") : bo.cache_dir);
  return builds;
}

}  // namespace width
}  // namespace nucleus
