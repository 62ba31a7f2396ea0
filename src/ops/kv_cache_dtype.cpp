#include "ops/kv_cache_dtype.h"

#include <cmath>

#include "core/check.h"

namespace nucleus {

const char* kv_cache_dtype_spellings() { return "auto, bf16, fp8, fp8_e4m3, fp8_ds_mla"; }

StatusOr<std::optional<KvCacheDtype>> parse_kv_cache_dtype(const std::string& s) {
  if (s == "auto") return std::optional<KvCacheDtype>();
  if (s == "bf16") return std::optional<KvCacheDtype>(KvCacheDtype::kBF16);
  if (s == "fp8" || s == "fp8_e4m3") return std::optional<KvCacheDtype>(KvCacheDtype::kFp8E4M3);
  if (s == "fp8_ds_mla") return std::optional<KvCacheDtype>(KvCacheDtype::kFp8DsMla);
  return invalid_argument("--kv-cache-dtype '" + s + "' is not one of " + kv_cache_dtype_spellings() +
                          " (fp8 and fp8_e4m3 are the same setting)");
}

StatusOr<KvCacheDtype> resolve_kv_cache_dtype(std::optional<KvCacheDtype> requested, Device device) {
  const KvCacheDtype d = requested.value_or(device == Device::kCuda ? KvCacheDtype::kBF16 : KvCacheDtype::kF32);
  if (device == Device::kCuda && d == KvCacheDtype::kF32)
    return unsupported("an f32 KV cache is CPU-only; on CUDA use --kv-cache-dtype bf16 or fp8");
  return d;
}

const char* kv_cache_dtype_name(KvCacheDtype d) {
  switch (d) {
    case KvCacheDtype::kF32: return "f32";
    case KvCacheDtype::kBF16: return "bf16";
    case KvCacheDtype::kFp8E4M3: return "fp8_e4m3";
    case KvCacheDtype::kFp8DsMla: return "fp8_ds_mla";
  }
  return "?";
}

DType kv_cache_storage_dtype(KvCacheDtype d) {
  switch (d) {
    case KvCacheDtype::kF32: return DType::kF32;
    case KvCacheDtype::kBF16: return DType::kBF16;
    case KvCacheDtype::kFp8E4M3: return DType::kF8E4M3;
    case KvCacheDtype::kFp8DsMla: return DType::kU8;
  }
  return DType::kBF16;
}

int64_t kv_cache_row_bytes(KvCacheDtype d, int64_t width) {
  if (d == KvCacheDtype::kFp8DsMla) return kDsMlaRowBytes;
  return width * static_cast<int64_t>(dtype_size(kv_cache_storage_dtype(d)));
}

Status check_kv_cache_dims(KvCacheDtype d, int64_t kv_lora, int64_t qk_rope) {
  if (d == KvCacheDtype::kFp8DsMla && (kv_lora != kDsMlaLatent || qk_rope != kDsMlaRope))
    return invalid_argument("--kv-cache-dtype fp8_ds_mla stores 512 latent and 64 rope values a row, but the model has "
                            "kv_lora_rank " + std::to_string(kv_lora) + " and qk_rope_head_dim " +
                            std::to_string(qk_rope) + "; use fp8 or bf16");
  return ok_status();
}

Status check_k_scale(float k_scale, const std::string& what) {
  if (!std::isfinite(k_scale) || !(k_scale > 0.0f))
    return invalid_argument(what + " is " + std::to_string(k_scale) + ": a KV-cache scale must be finite and > 0");
  return ok_status();
}

void encode_kv_row(const float* src, int64_t count, KvCacheDtype d, float k_scale, void* dst) {
  switch (d) {
    case KvCacheDtype::kFp8DsMla:
      NUCLEUS_CHECK(count == kDsMlaLatent + kDsMlaRope, "an fp8_ds_mla row is {} values, not {}",
                    kDsMlaLatent + kDsMlaRope, count);
      kernels::encode_ds_mla_row_ref(src, static_cast<uint8_t*>(dst));
      return;
    case KvCacheDtype::kF32: {
      auto* o = static_cast<float*>(dst);
      for (int64_t i = 0; i < count; ++i) o[i] = src[i];
      return;
    }
    case KvCacheDtype::kBF16: {
      auto* o = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) o[i] = f32_to_bf16(src[i]);
      return;
    }
    case KvCacheDtype::kFp8E4M3: {
      auto* o = static_cast<uint8_t*>(dst);
      for (int64_t i = 0; i < count; ++i) o[i] = f32_to_fp8e4m3(src[i] / k_scale);
      return;
    }
  }
}

void decode_kv_row(const void* src, int64_t count, KvCacheDtype d, float k_scale, float* dst) {
  if (d == KvCacheDtype::kFp8DsMla) {
    NUCLEUS_CHECK(count == kDsMlaLatent + kDsMlaRope, "an fp8_ds_mla row is {} values, not {}",
                  kDsMlaLatent + kDsMlaRope, count);
    kernels::decode_ds_mla_row_ref(static_cast<const uint8_t*>(src), dst);
    return;
  }
  convert_to_f32(src, kv_cache_storage_dtype(d), dst, static_cast<size_t>(count));
  if (d == KvCacheDtype::kFp8E4M3)
    for (int64_t i = 0; i < count; ++i) dst[i] *= k_scale;
}

}  // namespace nucleus
