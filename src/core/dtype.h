// Element types and the scalar conversions the CPU reference uses.
//   bf16: IEEE binary32 truncated to its top 16 bits; f32 -> bf16 rounds to
//         nearest even (what torch and CUDA's __float2bfloat16 do).
//   f8e4m3: OCP FP8 E4M3 "fn" (no infinities, 0x7f/0xff are NaN, max 448),
//         as torch.float8_e4m3fn; f32 -> f8 rounds to nearest even, saturates.
//   u8 as E8M0 scale: a byte e means 2^(e-127) (0xff is NaN).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/status.h"

namespace nucleus {

enum class DType : uint8_t { kF32, kBF16, kF16, kF8E4M3, kU8, kI32, kI64 };

// Bytes per element.
size_t dtype_size(DType dtype);
// Safetensors spelling: "F32", "BF16", "F16", "F8_E4M3", "U8", "I32", "I64".
const char* dtype_name(DType dtype);
// Parses a safetensors dtype string; other strings are kUnsupported.
StatusOr<DType> parse_safetensors_dtype(std::string_view name);

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// Rounds a float to the nearest bf16 value and back (what a bf16 store does).
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

float fp8e4m3_to_f32(uint8_t v);
uint8_t f32_to_fp8e4m3(float f);
constexpr float kFp8E4M3Max = 448.0f;

// E8M0 scale byte e -> 2^(e-127); 0xff -> NaN.
float e8m0_to_f32(uint8_t e);

// Converts `count` elements of `src` (dtype `src_dtype`) to f32.
// Supported: f32, bf16, f16, f8e4m3, u8 (as an integer value), i32.
void convert_to_f32(const void* src, DType src_dtype, float* dst, size_t count);

}  // namespace nucleus
