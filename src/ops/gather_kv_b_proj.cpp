// gather_kv_b_proj: reading kv_b_proj's format, the dispatch, and the CPU
// reference implementation. The CUDA implementations live in
// gather_kv_b_proj_cuda.cpp.
#include "ops/gather_kv_b_proj.h"

#include <fmt/format.h>

#include <vector>

#include "core/check.h"
#include "core/device.h"
#include "ops/op.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/gather_kv_b_proj_cuda.h"
#endif

namespace nucleus {

namespace {

constexpr const char* kFamily = "gather_kv_b_proj";

std::string describe_tensor(const Tensor& t) {
  return t.defined() ? std::string(dtype_name(t.dtype())) + " " + t.shape_string() : "none";
}

DType cache_dtype_of(KvCacheDtype d) {
  switch (d) {
    case KvCacheDtype::kF32:
      return DType::kF32;
    case KvCacheDtype::kBF16:
      return DType::kBF16;
    case KvCacheDtype::kFp8E4M3:
      return DType::kF8E4M3;
    case KvCacheDtype::kFp8DsMla:
      return DType::kU8;  // the 656-byte fp8_ds_mla row (kernels/mla/ds_mla_row.h)
  }
  return DType::kBF16;
}

// The CPU reference: f32 weight dequantized once, kernels::gather_kv_b_proj_ref per run.
class GatherKvBProjCpu final : public GatherKvBProj {
 public:
  GatherKvBProjCpu(const LinearWeight& kv_b, const kernels::KvBWeightFormat& f, const GatherKvBProjSpec& spec)
      : spec_(spec), weight_(static_cast<size_t>(kv_b.out_features * kv_b.in_features)) {
    const Tensor w = to_host(kv_b.weight);
    const Tensor s = kv_b.scale_inv.defined() ? to_host(kv_b.scale_inv) : Tensor();
    kernels::dequantize_kv_b_weight_ref(w.raw(), s.defined() ? s.raw() : nullptr, f, kv_b.out_features,
                                        kv_b.in_features, weight_.data());
  }
  const char* name() const override { return "cpu_ref"; }
  void run(const GatherKvBProjArgs& a) override {
    if (a.num_keys == 0) return;
    NUCLEUS_CHECK(a.cache && a.block_table && a.k && a.v && a.block_size > 0 && a.num_keys > 0 && a.key_begin >= 0,
                  "gather_kv_b_proj: bad args (num_keys {}, key_begin {}, block_size {})", a.num_keys, a.key_begin,
                  a.block_size);
    kernels::GatherKvBProjRefParams p;
    p.num_heads = spec_.num_heads;
    p.qk_nope = spec_.qk_nope;
    p.qk_rope = spec_.qk_rope;
    p.v_head = spec_.v_head;
    p.kv_lora = spec_.kv_lora;
    p.cache = a.cache;
    p.cache_dtype = cache_dtype_of(spec_.cache_dtype);
    p.k_scale = a.k_scale;
    p.block_table = a.block_table;
    p.block_size = a.block_size;
    p.key_begin = a.key_begin;
    p.num_keys = a.num_keys;
    p.weight = weight_.data();
    p.k = static_cast<float*>(a.k);
    p.v = static_cast<float*>(a.v);
    kernels::gather_kv_b_proj_ref(p);
  }

 private:
  GatherKvBProjSpec spec_;
  std::vector<float> weight_;  // [n, kv_lora]
};

Status cpu_supports(const LinearWeight&, const GatherKvBProjSpec& spec,
                    const StatusOr<kernels::KvBWeightFormat>& format) {
  return gather_kv_b_proj_impl::common_refusal(format, spec);
}

StatusOr<std::unique_ptr<GatherKvBProj>> cpu_make(const LinearWeight& kv_b, const GatherKvBProjSpec& spec,
                                                  const kernels::KvBWeightFormat& format) {
  return std::unique_ptr<GatherKvBProj>(new GatherKvBProjCpu(kv_b, format, spec));
}

struct Impl {
  const char* name;
  Device device;
  Status (*supports)(const LinearWeight&, const GatherKvBProjSpec&, const StatusOr<kernels::KvBWeightFormat>&);
  StatusOr<std::unique_ptr<GatherKvBProj>> (*make)(const LinearWeight&, const GatherKvBProjSpec&,
                                                   const kernels::KvBWeightFormat&);
};

// The dispatch order, whatever this build has. On CUDA the unfused path
// goes first: docs/perf.md "gather_kv_b_proj (cached-prefix K/V expansion)"
// measured it faster than the fused kernel at every shape (16 and 128 heads,
// bf16 and FP8 128x128-block weights, 4096 and 32768 keys; 1.2x to 2.1x).
// Rule: an implementation goes ahead of another only on a measured win at
// the shapes it serves; the fused kernel moves back ahead where a new
// measurement there shows it faster. The unfused path reads every layout the
// fused kernel reads, so the fused kernel serves by default only where the
// unfused one refuses (none today) and otherwise when forced. Memory: the
// unfused path's scratch comes from the step workspace (mla_prefill's
// cuda_flash counts it), and its bf16 copy of FP8 weights is made when the op
// is reserved, before the KV pool is sized.
struct Ordered {
  const char* name;
  Device device;
};
constexpr Ordered kOrder[] = {{"unfused", Device::kCuda}, {"fused", Device::kCuda}, {"cpu_ref", Device::kCpu}};

// In dispatch order (kOrder), those this build has.
const std::vector<Impl>& impls() {
  static const std::vector<Impl> list = [] {
    const Impl all[] = {
#ifdef NUCLEUS_HAVE_CUDA
        {"fused", Device::kCuda, gather_kv_b_proj_impl::fused_supports, gather_kv_b_proj_impl::fused_make},
        {"unfused", Device::kCuda, gather_kv_b_proj_impl::unfused_supports, gather_kv_b_proj_impl::unfused_make},
#endif
        {"cpu_ref", Device::kCpu, cpu_supports, cpu_make},
    };
    std::vector<Impl> l;
    for (const Ordered& o : kOrder)
      for (const Impl& i : all)
        if (std::string(i.name) == o.name && i.device == o.device) l.push_back(i);
    return l;
  }();
  return list;
}

Status check_spec(const LinearWeight& kv_b, const GatherKvBProjSpec& spec) {
  if (spec.num_heads <= 0 || spec.qk_nope <= 0 || spec.v_head <= 0 || spec.kv_lora <= 0 || spec.qk_rope < 0)
    return invalid_argument(fmt::format(
        "gather_kv_b_proj: spec needs positive num_heads, qk_nope, v_head, kv_lora (got {}, {}, {}, {}; qk_rope {})",
        spec.num_heads, spec.qk_nope, spec.v_head, spec.kv_lora, spec.qk_rope));
  if (!kv_b.weight.defined()) return invalid_argument("gather_kv_b_proj: kv_b_proj '" + kv_b.name + "' has no weight");
  const int64_t n = spec.num_heads * (spec.qk_nope + spec.v_head);
  if (kv_b.out_features != n || kv_b.in_features != spec.kv_lora)
    return invalid_argument(fmt::format(
        "gather_kv_b_proj: kv_b_proj '{}' is [{}, {}] but the spec needs [num_heads * (qk_nope + v_head), kv_lora] "
        "= [{}, {}]",
        kv_b.name, kv_b.out_features, kv_b.in_features, n, spec.kv_lora));
  return ok_status();
}

}  // namespace

Status gather_kv_b_proj_impl::common_refusal(const Format& format, const GatherKvBProjSpec& spec) {
  if (spec.shuffled_cache)
    return unsupported(
        "shuffled_cache is set: that cache layout is private to other kernels, and this implementation reads plain "
        "[num_slots, kv_lora + qk_rope] rows");
  if (spec.cache_dtype == KvCacheDtype::kFp8DsMla && (spec.kv_lora != kDsMlaLatent || spec.qk_rope != kDsMlaRope))
    return unsupported(fmt::format("fp8_ds_mla rows hold kv_lora 512 and qk_rope 64 (the spec has {} and {})",
                                   spec.kv_lora, spec.qk_rope));
  return format.status();
}

StatusOr<kernels::KvBWeightFormat> read_kv_b_weight_format(const LinearWeight& kv_b, const GatherKvBProjSpec& spec) {
  using kernels::KvBScaleLayout;
  const int64_t n = kv_b.out_features, k = kv_b.in_features;
  const Tensor& w = kv_b.weight;
  const Tensor& s = kv_b.scale_inv;
  const std::string who = "kv_b_proj '" + kv_b.name + "'";
  if (spec.packed_fp4_weight)
    return unsupported(who + " is marked packed FP4 (packed_fp4_weight), which no implementation unpacks; load it as "
                             "BF16 or FP8 E4M3");
  if (w.dtype() == DType::kU8) {
    if (w.rank() == 2 && w.dim(0) == n && w.dim(1) * 2 == k)
      return unsupported(who + " weight is U8 " + w.shape_string() +
                         " = [n, k/2]: packed FP4 (two 4-bit values a byte), which no implementation unpacks; load "
                         "it as BF16 or FP8 E4M3");
    return unsupported(who + " weight is U8 " + w.shape_string() + ", a packing no implementation reads");
  }
  if (w.rank() != 2 || w.dim(0) != n || w.dim(1) != k)
    return invalid_argument(who + " weight is " + w.shape_string() + fmt::format(", not [{}, {}]", n, k));
  kernels::KvBWeightFormat f;
  f.weight_dtype = w.dtype();
  if (w.dtype() == DType::kBF16 || w.dtype() == DType::kF32) {
    if (s.defined())
      return unsupported(who + " is " + dtype_name(w.dtype()) + " but carries scale_inv " + describe_tensor(s) +
                         ": an unknown scale layout for an unquantized weight");
    return f;
  }
  if (w.dtype() != DType::kF8E4M3)
    return unsupported(who + " weight dtype " + dtype_name(w.dtype()) + " is none of BF16, F32, F8_E4M3");
  if (!s.defined()) return unsupported(who + " is F8_E4M3 without scale_inv");
  if (s.dtype() != DType::kF32 && s.dtype() != DType::kU8)
    return unsupported(who + " scale_inv " + describe_tensor(s) + " is neither F32 nor U8 (E8M0)");
  f.scale_e8m0 = s.dtype() == DType::kU8;
  const int64_t bn = kv_b.block_n, bk = kv_b.block_k;
  if (s.rank() == 2 && bn > 0 && bk > 0 && s.dim(0) == (n + bn - 1) / bn && s.dim(1) == (k + bk - 1) / bk) {
    f.scale_layout = KvBScaleLayout::kBlock;
    f.block_n = bn;
    f.block_k = bk;
    return f;
  }
  if ((s.rank() == 1 && s.dim(0) == n) || (s.rank() == 2 && s.dim(0) == n && s.dim(1) == 1)) {
    f.scale_layout = KvBScaleLayout::kPerRow;
    return f;
  }
  const std::string block =
      bn > 0 && bk > 0 ? fmt::format("{}x{} block scales [ceil(n/block_n), ceil(k/block_k)] = [{}, {}]", bn, bk,
                                     (n + bn - 1) / bn, (k + bk - 1) / bk)
                       : std::string("block scales (block_n / block_k unset)");
  return unsupported(who + " scale_inv " + describe_tensor(s) +
                     fmt::format(" is neither per-row ([n] or [n, 1], n = {}) nor ", n) + block);
}

std::string describe_kv_b_weight_format(const kernels::KvBWeightFormat& f) {
  using kernels::KvBScaleLayout;
  std::string out = dtype_name(f.weight_dtype);
  const char* kind = f.scale_e8m0 ? "E8M0" : "F32";
  if (f.scale_layout == KvBScaleLayout::kPerRow) out += fmt::format(", per-row scales ({})", kind);
  if (f.scale_layout == KvBScaleLayout::kBlock)
    out += fmt::format(", {}x{} block scales ({})", f.block_n, f.block_k, kind);
  return out;
}

std::vector<std::string> GatherKvBProj::dispatch_order(Device device) {
  std::vector<std::string> names;
  for (const Ordered& o : kOrder)
    if (o.device == device) names.push_back(o.name);
  return names;
}

StatusOr<std::unique_ptr<GatherKvBProj>> GatherKvBProj::create(const LinearWeight& kv_b,
                                                               const GatherKvBProjSpec& spec, Device device) {
  return create(kv_b, spec, device, forced_backend(kFamily));
}

StatusOr<std::unique_ptr<GatherKvBProj>> GatherKvBProj::create(const LinearWeight& kv_b,
                                                               const GatherKvBProjSpec& spec, Device device,
                                                               const std::string& forced_name) {
  NUCLEUS_RETURN_IF_ERROR(check_spec(kv_b, spec));
  const auto format = read_kv_b_weight_format(kv_b, spec);
  if (!format.ok() && format.status().code() == StatusCode::kInvalidArgument) return format.status();
  // A forced name applies to the device that has an implementation of that name.
  std::string forced = forced_name, known;
  bool forced_here = false, forced_anywhere = false;
  for (const Impl& i : impls()) {
    forced_here |= i.device == device && forced == i.name;
    forced_anywhere |= forced == i.name;
    known += std::string(known.empty() ? "" : ", ") + i.name;
  }
  if (!forced.empty() && !forced_anywhere)
    return invalid_argument("NUCLEUS_FORCE_KERNEL names '" + forced + "' for " + kFamily +
                            ", which has no implementation of that name (known: " + known + ")");
  if (!forced_here) forced.clear();
  std::string reasons;
  for (const Impl& i : impls()) {
    if (i.device != device) continue;
    if (!forced.empty() && forced != i.name) {
      reasons += std::string("; ") + i.name + ": not the forced implementation";
      continue;
    }
    Status s = i.supports(kv_b, spec, format);
    if (s.ok()) return i.make(kv_b, spec, *format);
    reasons += std::string("; ") + i.name + ": " + s.message();
  }
  return unsupported(fmt::format("no {} implementation of {}{} reads kv_b_proj '{}' (weight {}, scale_inv {}): {}",
                                 device_name(device), kFamily,
                                 forced.empty() ? "" : " (NUCLEUS_FORCE_KERNEL=" + std::string(kFamily) + "=" + forced + ")",
                                 kv_b.name, describe_tensor(kv_b.weight), describe_tensor(kv_b.scale_inv),
                                 reasons.empty() ? "none for this device" : reasons.substr(2)));
}

}  // namespace nucleus
