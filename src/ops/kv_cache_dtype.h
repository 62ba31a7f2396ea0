// How the paged latent KV cache stores its rows, and the one convention every
// writer and reader of an FP8 cache follows (design.md "KV cache"; the scale
// convention is vLLM's and ATOM's for an fp8 KV cache):
//   stored = e4m3(value / k_scale)      (round to nearest even, saturating at 448)
//   read   = f32(stored) * k_scale
// A bf16 or f32 cache stores the value itself and is never scaled.
// k_scale is per layer (default 1.0; the checkpoint's k_scale / kv_scale
// tensors; --kv-scale overrides).
//
// The tile-scaled FP8 layout kFp8DsMla ("fp8_ds_mla", vLLM's name) stores a
// row as 512 e4m3 latent values with one f32 scale per 128 (max |x| / 448 of
// the tile) plus the 64 rope values in bf16: 656 bytes (the exact layout and
// rounding: kernels/mla/ds_mla_row.h). It reads no per-layer k_scale
// (--kv-scale is refused with it).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/status.h"
#include "core/tensor.h"
#include "kernels/mla/ds_mla_row.h"

namespace nucleus {

// The canonical cache dtype inside the engine (one value per setting: the
// spellings "fp8" and "fp8_e4m3" are both kFp8E4M3).
//   kF32:     the CPU reference's default (what "auto" means on the CPU).
//   kBF16:    the CUDA default (what "auto" means on CUDA); also on the CPU.
//   kFp8E4M3: OCP e4m3fn bytes with a per-layer k_scale, on both devices.
//   kFp8DsMla: the tile-scaled 656-byte row above, on both devices.
enum class KvCacheDtype { kF32, kBF16, kFp8E4M3, kFp8DsMla };

// The fp8_ds_mla row's geometry (DeepSeek MLA: kv_lora 512, qk_rope 64).
inline constexpr int64_t kDsMlaLatent = kernels::kDsMlaLatent;      // 512
inline constexpr int64_t kDsMlaRope = kernels::kDsMlaRope;          // 64
inline constexpr int64_t kDsMlaRowBytes = kernels::kDsMlaRowBytes;  // 656

// The accepted --kv-cache-dtype spellings, for messages:
// "auto, bf16, fp8, fp8_e4m3, fp8_ds_mla".
const char* kv_cache_dtype_spellings();

// Parses a --kv-cache-dtype value: "auto" -> nullopt (the device's default,
// see resolve_kv_cache_dtype), "bf16" -> kBF16, "fp8" and "fp8_e4m3" ->
// kFp8E4M3, "fp8_ds_mla" -> kFp8DsMla. Anything else (other case, "fp16", "fp8_e5m2", "") is
// kInvalidArgument naming the accepted values.
StatusOr<std::optional<KvCacheDtype>> parse_kv_cache_dtype(const std::string& s);

// The dtype for `device`: `requested`, or when unset the device default (CPU:
// kF32, CUDA: kBF16). kUnsupported for kF32 on CUDA (no CUDA kernel reads an
// f32 cache).
StatusOr<KvCacheDtype> resolve_kv_cache_dtype(std::optional<KvCacheDtype> requested, Device device);

// "f32", "bf16", "fp8_e4m3", "fp8_ds_mla" (the canonical name, for logs and graph dumps).
const char* kv_cache_dtype_name(KvCacheDtype d);
// The element type of the cache tensor: F32, BF16, F8_E4M3 (1 byte), or U8
// for kFp8DsMla (a row is kDsMlaRowBytes opaque bytes).
DType kv_cache_storage_dtype(KvCacheDtype d);
// Bytes of one cache row of `width` = kv_lora + qk_rope values:
// width * element size, or kDsMlaRowBytes (656) for kFp8DsMla.
int64_t kv_cache_row_bytes(KvCacheDtype d, int64_t width);
// True for the one layout that reads a per-layer k_scale (kFp8E4M3).
inline bool kv_cache_uses_k_scale(KvCacheDtype d) { return d == KvCacheDtype::kFp8E4M3; }
// Whether a model of these MLA dims can use cache `d`: kFp8DsMla needs
// kv_lora = 512 and qk_rope = 64 (kInvalidArgument naming the dims otherwise).
Status check_kv_cache_dims(KvCacheDtype d, int64_t kv_lora, int64_t qk_rope);

// Checks a k_scale: finite and > 0 (`what` names its source in the error).
Status check_k_scale(float k_scale, const std::string& what);

// CPU reference of the cache convention for `count` elements:
//   encode: dst[i] = stored(src[i]) in `d` (f32: copy; bf16: round to nearest
//           even; fp8: e4m3(src[i] / k_scale), the division in f32)
//   decode: dst[i] = f32(src[i]) (* k_scale for fp8 only)
// dst / src are `count` elements of kv_cache_storage_dtype(d). For kFp8DsMla
// one call is one whole row: count must be kDsMlaLatent + kDsMlaRope (576;
// checked), dst / src are kDsMlaRowBytes bytes, k_scale is ignored.
void encode_kv_row(const float* src, int64_t count, KvCacheDtype d, float k_scale, void* dst);
void decode_kv_row(const void* src, int64_t count, KvCacheDtype d, float k_scale, float* dst);

}  // namespace nucleus
