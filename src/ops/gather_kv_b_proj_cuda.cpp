// gather_kv_b_proj's CUDA implementations: the fused kernel (one launch) and
// the unfused path of plain steps (gather + dequantize -> cuBLASLt GEMM ->
// split/concat). See ops/gather_kv_b_proj.h.
#include <fmt/format.h>

#include <algorithm>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "kernels/gemm/gemm_cublaslt.h"
#include "kernels/gemm/gemm_naive.cuh"
#include "kernels/mla/gather_kv_b_proj.cuh"
#include "ops/gather_kv_b_proj.h"
#include "ops/gather_kv_b_proj_cuda.h"
#include "ops/op.h"
#include "ops/op_cuda_check.h"

namespace nucleus::gather_kv_b_proj_impl {

namespace {

// The kernels' spelling of the cache: kU8 is the fp8_ds_mla row (kernels/mla/ds_mla_row.h).
DType dtype_of(KvCacheDtype d) {
  switch (d) {
    case KvCacheDtype::kF32: return DType::kF32;
    case KvCacheDtype::kFp8E4M3: return DType::kF8E4M3;
    case KvCacheDtype::kFp8DsMla: return DType::kU8;
    case KvCacheDtype::kBF16: break;
  }
  return DType::kBF16;
}

Tensor on_device(const Tensor& t) {
  if (!t.defined() || t.device() == Device::kCuda) return t;
  return to_device(t);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

void check_args(const GatherKvBProjArgs& a, bool need_aligned) {
  NUCLEUS_CHECK(a.cache && a.block_table && a.k && a.v && a.block_size > 0 && a.num_keys >= 0 && a.key_begin >= 0,
                "gather_kv_b_proj: bad args (num_keys {}, key_begin {}, block_size {})", a.num_keys, a.key_begin,
                a.block_size);
  NUCLEUS_CHECK(!need_aligned || (aligned16(a.cache) && aligned16(a.k) && aligned16(a.v)),
                "gather_kv_b_proj: cache, k and v must be 16-byte aligned");
}

kernels::GatherKvBProjParams params_of(const GatherKvBProjSpec& s, const GatherKvBProjArgs& a) {
  kernels::GatherKvBProjParams p;
  p.num_heads = static_cast<int>(s.num_heads);
  p.qk_nope = static_cast<int>(s.qk_nope);
  p.qk_rope = static_cast<int>(s.qk_rope);
  p.v_head = static_cast<int>(s.v_head);
  p.kv_lora = static_cast<int>(s.kv_lora);
  p.cache = a.cache;
  p.cache_dtype = dtype_of(s.cache_dtype);
  p.k_scale = a.k_scale;
  p.block_table = a.block_table;
  p.block_size = static_cast<int>(a.block_size);
  p.key_begin = a.key_begin;
  p.num_keys = a.num_keys;
  p.k = static_cast<__nv_bfloat16*>(a.k);
  p.v = static_cast<__nv_bfloat16*>(a.v);
  return p;
}

Status need_device() {
  auto c = cuda::get_context();
  return c.ok() ? ok_status() : unsupported("no usable CUDA device: " + c.status().message());
}

class GatherKvBProjFused final : public GatherKvBProj {
 public:
  GatherKvBProjFused(Tensor weight, Tensor scale, const kernels::KvBWeightFormat& f, const GatherKvBProjSpec& spec)
      : weight_(std::move(weight)), scale_(std::move(scale)), format_(f), spec_(spec),
        num_sms_(cuda::context().num_sms) {}
  const char* name() const override { return "fused"; }
  void run(const GatherKvBProjArgs& a) override {
    check_args(a, true);
    kernels::GatherKvBProjParams p = params_of(spec_, a);
    p.weight = weight_.raw();
    p.scale = scale_.defined() ? scale_.raw() : nullptr;
    p.format = format_;
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_gather_kv_b_proj_fused(p, num_sms_, static_cast<cudaStream_t>(a.stream)));
  }

 private:
  Tensor weight_, scale_;
  kernels::KvBWeightFormat format_;
  GatherKvBProjSpec spec_;
  int num_sms_;
};

class GatherKvBProjUnfused final : public GatherKvBProj {
 public:
  GatherKvBProjUnfused(Tensor weight_bf16, const GatherKvBProjSpec& spec) : weight_(std::move(weight_bf16)), spec_(spec) {
    n_ = spec.num_heads * (spec.qk_nope + spec.v_head);
    width_ = spec.kv_lora + spec.qk_rope;
    // Keys per piece: the expanded [rows, n] bf16 scratch stays within budget.
    chunk_rows_ = std::max<int64_t>(128, kScratchBudgetBytes / (n_ * 2));
  }
  const char* name() const override { return "unfused"; }
  void reserve(int64_t max_num_keys) override {
    const int64_t rows = piece_rows(max_num_keys);
    if (latent_.defined() && latent_.dim(0) >= rows) return;
    latent_ = Tensor::empty({rows, width_}, DType::kBF16, Device::kCuda);
    kv_ = Tensor::empty({rows, n_}, DType::kBF16, Device::kCuda);
  }
  size_t workspace_bytes(int64_t max_num_keys) const override {
    const int64_t rows = piece_rows(max_num_keys);
    return kv_offset(rows) + up256(static_cast<size_t>(rows * n_) * 2);
  }
  void run(const GatherKvBProjArgs& a) override {
    check_args(a, true);
    if (a.num_keys == 0) return;
    __nv_bfloat16 *latent = nullptr, *kv = nullptr;
    int64_t piece = 0;
    if (a.workspace) {  // the caller's scratch: [piece, width] then [piece, n]
      piece = piece_rows(a.num_keys);
      NUCLEUS_CHECK(aligned16(a.workspace) && a.workspace_bytes >= workspace_bytes(a.num_keys),
                    "gather_kv_b_proj unfused: {} keys need {} bytes of 16-byte aligned workspace, got {}",
                    a.num_keys, workspace_bytes(a.num_keys), a.workspace_bytes);
      latent = static_cast<__nv_bfloat16*>(a.workspace);
      kv = reinterpret_cast<__nv_bfloat16*>(static_cast<uint8_t*>(a.workspace) + kv_offset(piece));
    } else {
      reserve(a.num_keys);
      piece = latent_.dim(0);
      latent = latent_.data<__nv_bfloat16>();
      kv = kv_.data<__nv_bfloat16>();
    }
    const auto stream = static_cast<cudaStream_t>(a.stream);
    const int64_t k_row = spec_.qk_nope + spec_.qk_rope;
    for (int64_t j0 = 0; j0 < a.num_keys; j0 += piece) {
      const int64_t rows = std::min(piece, a.num_keys - j0);
      // 1. gather + dequantize (FP8 x k_scale) to bf16.
      NUCLEUS_OP_CUDA_CHECK(kernels::launch_gather_dequant_latent(a.cache, dtype_of(spec_.cache_dtype),
                                                               static_cast<int>(width_), a.k_scale, a.block_table,
                                                               static_cast<int>(a.block_size), a.key_begin + j0, rows,
                                                               latent, stream));
      // 2. kv = latent[:, :kv_lora] W^T (cuBLASLt; the plain GEMM where it finds no algorithm).
      kernels::GemmArgs g;
      g.x = latent;
      g.x_stride = width_;
      g.w = weight_.raw();
      g.out = kv;
      g.out_stride = n_;
      g.out_dtype = DType::kBF16;
      g.m = rows;
      g.n = n_;
      g.k = spec_.kv_lora;
      if (!kernels::gemm_bf16_cublaslt(g, stream).ok()) {
        kernels::WeightView wv{weight_.raw(), nullptr, n_, spec_.kv_lora, 0, 0};
        NUCLEUS_OP_CUDA_CHECK(kernels::launch_gemm_naive(latent, width_, wv, rows, kv, DType::kBF16, n_, false, stream));
      }
      // 3. split into k_nope / v, append k_pe.
      auto* k = static_cast<__nv_bfloat16*>(a.k) + j0 * spec_.num_heads * k_row;
      auto* v = static_cast<__nv_bfloat16*>(a.v) + j0 * spec_.num_heads * spec_.v_head;
      NUCLEUS_OP_CUDA_CHECK(kernels::launch_split_kv(kv, latent, static_cast<int>(spec_.num_heads),
                                                  static_cast<int>(spec_.qk_nope), static_cast<int>(spec_.qk_rope),
                                                  static_cast<int>(spec_.v_head), static_cast<int>(spec_.kv_lora),
                                                  rows, k, v, stream));
    }
  }

 private:
  static constexpr int64_t kScratchBudgetBytes = 256ll << 20;
  static size_t up256(size_t x) { return (x + 255) / 256 * 256; }
  // Keys a piece of a run of `num_keys` keys expands at once.
  int64_t piece_rows(int64_t num_keys) const { return std::min(std::max<int64_t>(num_keys, 1), chunk_rows_); }
  size_t kv_offset(int64_t rows) const { return up256(static_cast<size_t>(rows * width_) * 2); }
  Tensor weight_;  // [n, kv_lora] bf16 on the device
  GatherKvBProjSpec spec_;
  int64_t n_ = 0, width_ = 0, chunk_rows_ = 0;
  Tensor latent_, kv_;  // scratch: [piece, width] and [piece, n] bf16
};

}  // namespace

Status fused_supports(const LinearWeight& kv_b, const GatherKvBProjSpec& spec, const Format& format) {
  NUCLEUS_RETURN_IF_ERROR(common_refusal(format, spec));
  if (spec.cache_dtype == KvCacheDtype::kFp8DsMla)
    return unsupported("KV cache dtype fp8_ds_mla: the fused kernel's gather reads bf16 or fp8_e4m3 rows, not the "
                       "tile-scaled 656-byte rows (the unfused path reads them)");
  const kernels::KvBWeightFormat& f = *format;
  if (f.weight_dtype != DType::kBF16 && f.weight_dtype != DType::kF8E4M3)
    return unsupported(std::string(dtype_name(f.weight_dtype)) +
                       " weight: the fused kernel reads BF16 or F8_E4M3 weights (the unfused path converts it)");
  if (spec.kv_lora % kernels::kGkvFusedTileK != 0 || spec.qk_nope % 8 || spec.v_head % 8 || spec.qk_rope % 8)
    return unsupported(fmt::format(
        "needs kv_lora % 64 == 0 and qk_nope, v_head, qk_rope % 8 == 0 (got kv_lora {}, qk_nope {}, v_head {}, "
        "qk_rope {})",
        spec.kv_lora, spec.qk_nope, spec.v_head, spec.qk_rope));
  if (f.scale_layout == kernels::KvBScaleLayout::kBlock &&
      (f.block_n % kernels::kGkvFusedTileN != 0 || f.block_k % kernels::kGkvFusedTileK != 0))
    return unsupported(fmt::format(
        "{}x{} block scales: the fused kernel needs block_n % 128 == 0 and block_k % 64 == 0 (one scale per tile "
        "and k step)",
        f.block_n, f.block_k));
  NUCLEUS_RETURN_IF_ERROR(need_device());
  int optin = 0;
  NUCLEUS_OP_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, cuda::context().device));
  const int64_t smem =
      kernels::gather_kv_b_proj_fused_smem_bytes(static_cast<int>(spec.kv_lora), f.weight_dtype == DType::kF8E4M3);
  if (smem > optin)
    return unsupported(fmt::format("kv_lora {} needs {} bytes of shared memory per CTA, over the device's {}",
                                   spec.kv_lora, smem, optin));
  return ok_status();
}

StatusOr<std::unique_ptr<GatherKvBProj>> fused_make(const LinearWeight& kv_b, const GatherKvBProjSpec& spec,
                                                    const kernels::KvBWeightFormat& format) {
  NUCLEUS_OP_CUDA_CHECK(kernels::gather_kv_b_proj_fused_prepare());
  return std::unique_ptr<GatherKvBProj>(
      new GatherKvBProjFused(on_device(kv_b.weight), on_device(kv_b.scale_inv), format, spec));
}

Status unfused_supports(const LinearWeight& kv_b, const GatherKvBProjSpec& spec, const Format& format) {
  NUCLEUS_RETURN_IF_ERROR(common_refusal(format, spec));
  return need_device();
}

StatusOr<std::unique_ptr<GatherKvBProj>> unfused_make(const LinearWeight& kv_b, const GatherKvBProjSpec& spec,
                                                      const kernels::KvBWeightFormat& format) {
  Tensor weight = on_device(kv_b.weight);
  if (format.weight_dtype != DType::kBF16) {  // FP8 (scaled) or F32: to bf16 once, here
    const Tensor scale = on_device(kv_b.scale_inv);
    NUCLEUS_ASSIGN_OR_RETURN(Tensor bf16, try_empty({kv_b.out_features, kv_b.in_features}, DType::kBF16,
                                                    Device::kCuda, "gather_kv_b_proj unfused: bf16 kv_b_proj"));
    cudaStream_t stream = cuda::context().stream;
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_dequantize_kv_b_weight(weight.raw(), scale.defined() ? scale.raw() : nullptr,
                                                              format, kv_b.out_features, kv_b.in_features,
                                                              bf16.data<__nv_bfloat16>(), stream));
    NUCLEUS_OP_CUDA_CHECK(cudaStreamSynchronize(stream));
    weight = bf16;
  }
  return std::unique_ptr<GatherKvBProj>(new GatherKvBProjUnfused(std::move(weight), spec));
}

}  // namespace nucleus::gather_kv_b_proj_impl
