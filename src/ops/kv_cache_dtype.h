// How the paged latent KV cache stores its rows, and the one convention every
// writer and reader of an FP8 cache follows (design.md "KV cache"; the scale
// convention is vLLM's and ATOM's for an fp8 KV cache):
//   stored = e4m3(value / k_scale)      (round to nearest even, saturating at 448)
//   read   = f32(stored) * k_scale
// A bf16 or f32 cache stores the value itself and is never scaled.
// k_scale is per layer (default 1.0; the checkpoint's k_scale / kv_scale
// tensors; --kv-scale overrides).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/status.h"
#include "core/tensor.h"

namespace nucleus {

// The canonical cache dtype inside the engine (one value per setting: the
// spellings "fp8" and "fp8_e4m3" are both kFp8E4M3).
//   kF32:     the CPU reference's default (what "auto" means on the CPU).
//   kBF16:    the CUDA default (what "auto" means on CUDA); also on the CPU.
//   kFp8E4M3: OCP e4m3fn bytes with a per-layer k_scale, on both devices.
enum class KvCacheDtype { kF32, kBF16, kFp8E4M3 };

// The accepted --kv-cache-dtype spellings, for messages: "auto, bf16, fp8, fp8_e4m3".
const char* kv_cache_dtype_spellings();

// Parses a --kv-cache-dtype value: "auto" -> nullopt (the device's default,
// see resolve_kv_cache_dtype), "bf16" -> kBF16, "fp8" and "fp8_e4m3" ->
// kFp8E4M3. Anything else (other case, "fp16", "fp8_e5m2", "") is
// kInvalidArgument naming the accepted values.
StatusOr<std::optional<KvCacheDtype>> parse_kv_cache_dtype(const std::string& s);

// The dtype for `device`: `requested`, or when unset the device default (CPU:
// kF32, CUDA: kBF16). kUnsupported for kF32 on CUDA (no CUDA kernel reads an
// f32 cache).
StatusOr<KvCacheDtype> resolve_kv_cache_dtype(std::optional<KvCacheDtype> requested, Device device);

// "f32", "bf16", "fp8_e4m3" (the canonical name, for logs and graph dumps).
const char* kv_cache_dtype_name(KvCacheDtype d);
// The element type of the cache tensor: F32, BF16 or F8_E4M3 (1 byte).
DType kv_cache_storage_dtype(KvCacheDtype d);

// Checks a k_scale: finite and > 0 (`what` names its source in the error).
Status check_k_scale(float k_scale, const std::string& what);

// CPU reference of the cache convention for `count` elements:
//   encode: dst[i] = stored(src[i]) in `d` (f32: copy; bf16: round to nearest
//           even; fp8: e4m3(src[i] / k_scale), the division in f32)
//   decode: dst[i] = f32(src[i]) (* k_scale for fp8 only)
// dst / src are `count` elements of kv_cache_storage_dtype(d).
void encode_kv_row(const float* src, int64_t count, KvCacheDtype d, float k_scale, void* dst);
void decode_kv_row(const void* src, int64_t count, KvCacheDtype d, float k_scale, float* dst);

}  // namespace nucleus
