#include "core/dtype.h"

#include <array>
#include <cmath>
#include <limits>

#include "core/check.h"

namespace nucleus {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kU8: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  NUCLEUS_CHECK(false, "bad dtype {}", static_cast<int>(dtype));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kU8: return "U8";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
  }
  return "?";
}

StatusOr<DType> parse_safetensors_dtype(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kF16;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  if (name == "U8") return DType::kU8;
  if (name == "I32") return DType::kI32;
  if (name == "I64") return DType::kI64;
  return unsupported("dtype '" + std::string(name) +
                     "' is not supported (expected F32, BF16, F16, F8_E4M3, U8, I32 or I64)");
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t sign = (bits >> 16) & 0x8000u;
  float a = std::fabs(f);
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a < std::ldexp(1.0f, -14)) {  // subnormal: multiples of 2^-24
    float q = std::nearbyint(a * std::ldexp(1.0f, 24));
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(q));
  }
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  float scaled = std::nearbyint(std::ldexp(a, 11 - e));  // 11 significant bits
  uint32_t mant = static_cast<uint32_t>(scaled);
  int exp = e - 1 + 15;
  if (mant == 2048u) { mant = 1024u; ++exp; }
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | (mant & 0x3ffu));
}

namespace {
std::array<float, 256> make_fp8_table() {
  std::array<float, 256> t{};
  for (int v = 0; v < 256; ++v) {
    int sign = v >> 7, exp = (v >> 3) & 0xf, mant = v & 7;
    float x;
    if (exp == 0xf && mant == 7) {
      x = std::numeric_limits<float>::quiet_NaN();
    } else if (exp == 0) {
      x = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant/8 * 2^-6
    } else {
      x = std::ldexp(static_cast<float>(8 + mant), exp - 10);  // (1+mant/8) * 2^(exp-7)
    }
    t[v] = sign ? -x : x;
  }
  return t;
}
const std::array<float, 256> kFp8Table = make_fp8_table();
}  // namespace

float fp8e4m3_to_f32(uint8_t v) { return kFp8Table[v]; }

uint8_t f32_to_fp8e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= kFp8E4M3Max) return sign | 0x7e;  // saturate to 448
  // Find the nearest representable magnitude, ties to even mantissa.
  if (a < std::ldexp(1.0f, -6)) {  // subnormal range, step 2^-9
    float q = std::nearbyint(a * 512.0f);
    return sign | static_cast<uint8_t>(q);  // q == 8 is exactly the smallest normal
  }
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  float q = std::nearbyint(std::ldexp(a, 4 - e));  // 4 significant bits: 8..16
  int exp = e - 1 + 7;
  int mant = static_cast<int>(q);
  if (mant == 16) { mant = 8; ++exp; }
  if (exp > 15 || (exp == 15 && mant - 8 > 6)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((exp << 3) | (mant - 8));
}

float e8m0_to_f32(uint8_t e) {
  if (e == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(e) - 127);
}

void convert_to_f32(const void* src, DType src_dtype, float* dst, size_t count) {
  switch (src_dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kBF16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::kF16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::kF8E4M3: {
      auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = kFp8Table[s[i]];
      return;
    }
    case DType::kU8: {
      auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::kI32: {
      auto* s = static_cast<const int32_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::kI64:
      break;
  }
  NUCLEUS_CHECK(false, "convert_to_f32: unsupported source dtype {}", dtype_name(src_dtype));
}

}  // namespace nucleus
