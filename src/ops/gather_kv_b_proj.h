// gather_kv_b_proj: the cached-prefix K/V expansion of MLA prefill
// (design.md "Cached-prefix prefill"; seed 001).
//
// For cached positions [key_begin, key_begin + num_keys) of one sequence:
//   latent_j = cache[slot(j)]                  (block table -> slot)
//   latent_j = latent_j * k_scale              (FP8 e4m3 cache only; a bf16/f32 cache is never scaled)
//   kv_j     = kv_b_proj(latent_j[:kv_lora])   ([num_heads * (qk_nope + v_head)])
//   k[j, h]  = [kv_j[h, :qk_nope] | latent_j[kv_lora:]]   (k_pe broadcast to every head)
//   v[j, h]  = kv_j[h, qk_nope:]
// Outputs: k [num_keys, num_heads, qk_nope + qk_rope], v [num_keys, num_heads, v_head].
//
// Implementations behind one dispatch, in order: a fused CUDA kernel (one
// launch), then an unfused path of plain steps (gather, dequantize, GEMM,
// split, concat); the CPU reference on the CPU. A weight or cache layout none
// can read (packed FP4 weights, unknown scale shapes, shuffled caches) is
// refused by create(), when the model is built. NUCLEUS_FORCE_KERNEL=
// gather_kv_b_proj=<fused|unfused> picks one for A/B runs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "core/tensor.h"
#include "ops/linear_weight.h"

namespace nucleus {

// How the latent cache stores rows.
enum class KvCacheDtype { kF32, kBF16, kFp8E4M3 };

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
};

struct GatherKvBProjArgs {
  const void* cache = nullptr;  // this layer: [num_slots, kv_lora + qk_rope] in cache_dtype
  float k_scale = 1.0f;         // FP8 cache only
  const int32_t* block_table = nullptr;  // this sequence's block table (device on CUDA)
  int64_t block_size = 0;
  int64_t key_begin = 0;
  int64_t num_keys = 0;
  void* k = nullptr;  // [num_keys, num_heads, qk_nope + qk_rope] (bf16 on CUDA, f32 on CPU)
  void* v = nullptr;  // [num_keys, num_heads, v_head]
  void* stream = nullptr;  // cudaStream_t on CUDA
};

class GatherKvBProj {
 public:
  virtual ~GatherKvBProj() = default;
  // Chooses the implementation for `device`; kUnsupported with every
  // implementation's reason when none can read this weight/cache layout.
  static StatusOr<std::unique_ptr<GatherKvBProj>> create(const LinearWeight& kv_b, const GatherKvBProjSpec& spec,
                                                         Device device);
  // The chosen implementation: "fused", "unfused" or "cpu_ref".
  virtual const char* name() const = 0;
  // Stream-async on CUDA. Scratch is owned by the object (grown on demand).
  virtual void run(const GatherKvBProjArgs& args) = 0;
};

}  // namespace nucleus
