// gather_kv_b_proj: the cached-prefix K/V expansion of MLA prefill
// (design.md "Cached-prefix prefill"; seed 001).
//
// For cached positions [key_begin, key_begin + num_keys) of one sequence:
//   latent_j = cache[slot(j)]                  (block table -> slot)
//   latent_j = latent_j * k_scale              (FP8 e4m3 cache only; a bf16/f32 cache is never scaled;
//                                               an fp8_ds_mla row is read with its tile scales)
//   kv_j     = kv_b_proj(latent_j[:kv_lora])   ([num_heads * (qk_nope + v_head)])
//   k[j, h]  = [kv_j[h, :qk_nope] | latent_j[kv_lora:]]   (k_pe broadcast to every head)
//   v[j, h]  = kv_j[h, qk_nope:]
// Outputs: k [num_keys, num_heads, qk_nope + qk_rope], v [num_keys, num_heads, v_head].
//
// Implementations behind one dispatch, in order (dispatch_order()): on CUDA
// an unfused path of plain steps (gather, dequantize, cuBLASLt GEMM, split,
// concat), then a fused kernel (one launch); the CPU reference on the CPU.
// The unfused path goes first because it is the faster at every shape
// measured on the H200 (docs/perf.md "gather_kv_b_proj (cached-prefix K/V
// expansion)": 1.2x at 16 heads with bf16 weights to 2.1x at 128 heads with
// FP8, 4k and 32k keys); the fused kernel serves only where it is forced,
// since the unfused path reads every layout the fused kernel does. A weight or
// cache layout none can read (packed FP4 weights, unknown scale shapes,
// shuffled caches) is refused by create(), when the model is built; the fused
// kernel refuses an fp8_ds_mla cache (the unfused path and the CPU reference
// read it). NUCLEUS_FORCE_KERNEL=gather_kv_b_proj=<fused|unfused> picks one
// for A/B runs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "kernels/mla/gather_kv_b_proj_ref.h"
#include "ops/kv_cache_dtype.h"
#include "ops/linear_weight.h"

namespace nucleus {

// How kv_b_proj's weight is stored (read off LinearWeight by create()):
//   bf16/f32 weights; FP8 e4m3 with per-row scales ([n] or [n, 1] f32);
//   FP8 e4m3 with block scales ([ceil(n/bn), ceil(k/bk)], f32 or E8M0 u8).
struct GatherKvBProjSpec {
  int64_t num_heads = 0;
  int64_t qk_nope = 0;
  int64_t qk_rope = 0;
  int64_t v_head = 0;
  int64_t kv_lora = 0;
  KvCacheDtype cache_dtype = KvCacheDtype::kBF16;
  bool shuffled_cache = false;  // a layout private to some kernels; always refused
  // kv_b_proj holds packed FP4 values (e.g. MXFP4), whatever its dtype says;
  // always refused (a U8 weight of shape [n, k/2] is recognised as such too).
  bool packed_fp4_weight = false;
};

struct GatherKvBProjArgs {
  const void* cache = nullptr;  // this layer: [num_slots, kv_lora + qk_rope] in cache_dtype (656-byte rows for fp8_ds_mla)
  float k_scale = 1.0f;         // FP8 cache only
  const int32_t* block_table = nullptr;  // this sequence's block table (device on CUDA)
  int64_t block_size = 0;
  int64_t key_begin = 0;
  int64_t num_keys = 0;
  void* k = nullptr;  // [num_keys, num_heads, qk_nope + qk_rope] (bf16 on CUDA, f32 on CPU)
  void* v = nullptr;  // [num_keys, num_heads, v_head]
  void* stream = nullptr;  // cudaStream_t on CUDA
  // Caller-owned device scratch (16-byte aligned) of at least
  // GatherKvBProj::workspace_bytes(num_keys) bytes, e.g. a slice of the step
  // workspace; null: the object's own scratch, grown on demand (reserve()).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

class GatherKvBProj {
 public:
  virtual ~GatherKvBProj() = default;
  // Chooses the implementation for `device`; kUnsupported with every
  // implementation's reason when none can read this weight/cache layout.
  static StatusOr<std::unique_ptr<GatherKvBProj>> create(const LinearWeight& kv_b, const GatherKvBProjSpec& spec,
                                                         Device device);
  // As above with the forced implementation given ("" = none) instead of
  // read from NUCLEUS_FORCE_KERNEL: forcing one that refuses is an error.
  // Weights on the other device are copied; FP8 weights are dequantized to
  // BF16 once here when the unfused path serves them.
  static StatusOr<std::unique_ptr<GatherKvBProj>> create(const LinearWeight& kv_b, const GatherKvBProjSpec& spec,
                                                         Device device, const std::string& forced);
  // The chosen implementation: "fused", "unfused" or "cpu_ref".
  virtual const char* name() const = 0;
  // Stream-async on CUDA. Scratch is owned by the object (grown on demand).
  virtual void run(const GatherKvBProjArgs& args) = 0;
  // Allocates now the scratch that runs of up to max_num_keys keys need, so
  // that a later run (under CUDA-graph capture, say) allocates nothing.
  virtual void reserve(int64_t max_num_keys) {}
  // Device bytes of GatherKvBProjArgs::workspace a run of up to max_num_keys
  // keys uses when the caller passes it (0: the implementation needs none).
  // The unfused path: latent [piece, kv_lora + qk_rope] and kv [piece,
  // num_heads * (qk_nope + v_head)] bf16, piece = min(max_num_keys, the keys
  // whose kv fits 256 MiB), each rounded up to 256 bytes.
  virtual size_t workspace_bytes(int64_t max_num_keys) const { return 0; }
  // The implementation names create() tries for `device`, in order, whether
  // or not this build has them: {"unfused", "fused"} on CUDA, {"cpu_ref"} on
  // the CPU.
  static std::vector<std::string> dispatch_order(Device device);
};

// kv_b_proj's stored format as every implementation reads it:
//   weight BF16 / F32: no scales (scale_inv must be undefined);
//   weight F8_E4M3 with scale_inv F32 or U8 (E8M0: byte e means 2^(e-127)) of
//     shape [n] or [n, 1] (per-row), or [ceil(n/block_n), ceil(k/block_k)]
//     with block_n, block_k set (block scales).
// kUnsupported naming the weight when it is none of these: packed FP4 (a U8
// weight, or spec.packed_fp4_weight), an unknown scale shape or dtype.
StatusOr<kernels::KvBWeightFormat> read_kv_b_weight_format(const LinearWeight& kv_b,
                                                           const GatherKvBProjSpec& spec);

// "F8_E4M3, 128x128 block scales (E8M0)" and the like, for messages and logs.
std::string describe_kv_b_weight_format(const kernels::KvBWeightFormat& f);

// The implementations as the dispatch lists them (internal; the CUDA ones are
// declared in gather_kv_b_proj_cuda.h). supports() returns OK or why not.
namespace gather_kv_b_proj_impl {
using Format = StatusOr<kernels::KvBWeightFormat>;
// What every implementation refuses: a shuffled cache, an unreadable format.
Status common_refusal(const Format& format, const GatherKvBProjSpec& spec);
}  // namespace gather_kv_b_proj_impl

}  // namespace nucleus
