// Scalar conversions of core/dtype.h (bf16, f16, fp8 e4m3, e8m0) against
// hand-computed values, plus the FP8 block dequantization of the CPU reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "kernels/gemm/gemm_ref.h"

namespace nucleus {
namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------- bf16

TEST(DTypeTest, Bf16HandValues) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(kInf), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-kInf), 0xff80);
  // pi = 0x40490fdb: the dropped half 0x0fdb is below halfway -> 0x4049.
  EXPECT_EQ(f32_to_bf16(3.14159265f), 0x4049);
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(bf16_to_f32(0x0001), std::ldexp(1.0f, -133));  // smallest bf16 subnormal
}

TEST(DTypeTest, Bf16RoundsHalfwayToEven) {
  // 1 + 2^-8 lies exactly between 1.0 (0x3f80, even) and 1 + 2^-7 (0x3f81).
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808000)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 lies between 0x3f81 (odd) and 0x3f82 (even).
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f818000)), 0x3f82);
  // One ulp either side of halfway rounds to the nearer value.
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808001)), 0x3f81);
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f817fff)), 0x3f81);
  // Negative values round the magnitude the same way.
  EXPECT_EQ(f32_to_bf16(from_bits(0xbf808000)), 0xbf80);
  EXPECT_EQ(f32_to_bf16(from_bits(0xbf818000)), 0xbf82);
  // The largest finite float rounds up into infinity (as torch does).
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(round_to_bf16(1.0f + std::ldexp(1.0f, -9)), 1.0f);
}

TEST(DTypeTest, Bf16AllMidpointsRoundToEven) {
  // For every pair of consecutive finite positive bf16 values h, h+1, the f32
  // midpoint rounds to the even one and one f32 ulp either side to the nearer.
  for (uint32_t h = 0; h < 0x7f80; ++h) {
    const uint32_t mid = (h << 16) | 0x8000u;
    const uint16_t even = static_cast<uint16_t>((h & 1u) ? h + 1 : h);
    ASSERT_EQ(f32_to_bf16(from_bits(mid)), even) << std::hex << h;
    ASSERT_EQ(f32_to_bf16(from_bits(mid - 1)), h) << std::hex << h;
    ASSERT_EQ(f32_to_bf16(from_bits(mid + 1)), h + 1) << std::hex << h;
    ASSERT_EQ(f32_to_bf16(from_bits(mid | 0x80000000u)), even | 0x8000u) << std::hex << h;
  }
}

TEST(DTypeTest, Bf16NaNStaysNaN) {
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(kNaN))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(-kNaN))));
  // NaNs whose payload lives only in the low 16 bits must not become inf.
  for (uint32_t nan : {0x7f800001u, 0x7f80ffffu, 0xff800001u, 0x7fffffffu, 0x7fc00000u}) {
    uint16_t h = f32_to_bf16(from_bits(nan));
    EXPECT_TRUE(std::isnan(bf16_to_f32(h))) << std::hex << nan << " -> " << h;
    EXPECT_EQ(h & 0x8000u, (nan >> 16) & 0x8000u) << std::hex << nan;  // sign kept
  }
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7fc0)));
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7f81)));
}

TEST(DTypeTest, Bf16RoundTripOfEveryValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), h) << std::hex << h;
  }
}

// ---------------------------------------------------------------- f16

TEST(DTypeTest, F16ToF32HandValues) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);  // (1 + 341/1024) * 2^-2
  EXPECT_EQ(f16_to_f32(0x2e66), 0.0999755859375f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);        // largest finite
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03ff), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(f16_to_f32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x0000), 0.0f);
  EXPECT_TRUE(std::signbit(f16_to_f32(0x8000)));
  EXPECT_EQ(f16_to_f32(0x7c00), kInf);
  EXPECT_EQ(f16_to_f32(0xfc00), -kInf);
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7c01)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0xfe00)));
}

TEST(DTypeTest, F32ToF16HandValues) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(0.1f), 0x2e66);  // 1.6 * 2^-4: mantissa 614.4 -> 614
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  // Normal-range ties: 1 + 2^-11 is halfway between 0x3c00 and 0x3c01.
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(f32_to_f16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Largest finite, and overflow: 65520 is halfway to 65536 and rounds to inf.
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-1e6f), 0xfc00);
  EXPECT_EQ(f32_to_f16(kInf), 0x7c00);
  EXPECT_EQ(f32_to_f16(-kInf), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::max()), 0x7c00);
  // NaN stays NaN.
  uint16_t n = f32_to_f16(kNaN);
  EXPECT_EQ(n & 0x7c00u, 0x7c00u);
  EXPECT_NE(n & 0x03ffu, 0u);
  // Subnormals: multiples of 2^-24, ties to even.
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(f32_to_f16(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);       // halfway 0 / 1 -> 0
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);       // halfway 1 / 2 -> 2
  EXPECT_EQ(f32_to_f16(std::ldexp(5.0f, -25)), 0x0002);       // halfway 2 / 3 -> 2
  EXPECT_EQ(f32_to_f16(std::ldexp(1.2f, -24)), 0x0001);
  EXPECT_EQ(f32_to_f16(std::ldexp(1023.0f, -24)), 0x03ff);    // largest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1023.5f, -24)), 0x0400);    // tie into the smallest normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);       // smallest normal
  EXPECT_EQ(f32_to_f16(1e-30f), 0x0000);                      // underflow
  EXPECT_EQ(f32_to_f16(-1e-30f), 0x8000);
}

TEST(DTypeTest, F16AllMidpointsRoundToEven) {
  // Every pair of consecutive finite positive f16 values, including the
  // subnormal/normal boundary and 0x7bff -> inf.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const float lo = f16_to_f32(static_cast<uint16_t>(h));
    const float hi = h + 1 == 0x7c00 ? 65536.0f : f16_to_f32(static_cast<uint16_t>(h + 1));
    const float mid = (lo + hi) / 2;  // exact: f16 has 11 significant bits
    const uint16_t even = static_cast<uint16_t>((h & 1u) ? h + 1 : h);
    ASSERT_EQ(f32_to_f16(mid), even) << std::hex << h;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, 0.0f)), h) << std::hex << h;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, kInf)), h + 1) << std::hex << h;
    ASSERT_EQ(f32_to_f16(-mid), even | 0x8000u) << std::hex << h;
  }
}

TEST(DTypeTest, F16RoundTripOfEveryValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
}

// ---------------------------------------------------------------- fp8 e4m3

TEST(DTypeTest, Fp8DecodeHandValues) {
  EXPECT_EQ(fp8e4m3_to_f32(0x00), 0.0f);
  EXPECT_FALSE(std::signbit(fp8e4m3_to_f32(0x00)));
  EXPECT_EQ(fp8e4m3_to_f32(0x80), 0.0f);
  EXPECT_TRUE(std::signbit(fp8e4m3_to_f32(0x80)));
  EXPECT_EQ(fp8e4m3_to_f32(0x38), 1.0f);    // exp 7, mant 0
  EXPECT_EQ(fp8e4m3_to_f32(0xb8), -1.0f);
  EXPECT_EQ(fp8e4m3_to_f32(0x3c), 1.5f);    // exp 7, mant 4
  EXPECT_EQ(fp8e4m3_to_f32(0x30), 0.5f);    // exp 6
  EXPECT_EQ(fp8e4m3_to_f32(0x40), 2.0f);    // exp 8
  EXPECT_EQ(fp8e4m3_to_f32(0x44), 3.0f);    // exp 8, mant 4
  EXPECT_EQ(fp8e4m3_to_f32(0x77), 240.0f);  // exp 14, mant 7: 1.875 * 128
  EXPECT_EQ(fp8e4m3_to_f32(0x78), 256.0f);  // exp 15, mant 0
  EXPECT_EQ(fp8e4m3_to_f32(0x7d), 416.0f);  // exp 15, mant 5
  EXPECT_EQ(fp8e4m3_to_f32(0x7e), 448.0f);  // largest finite
  EXPECT_EQ(fp8e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8e4m3_to_f32(0x07), std::ldexp(7.0f, -9));  // largest subnormal
  EXPECT_EQ(fp8e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(fp8e4m3_to_f32(0x81), -std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(0xff)));
  EXPECT_EQ(kFp8E4M3Max, 448.0f);
  // Only 0x7f and 0xff are NaN ("fn": no infinities).
  int nans = 0;
  for (int b = 0; b < 256; ++b) {
    float f = fp8e4m3_to_f32(static_cast<uint8_t>(b));
    EXPECT_FALSE(std::isinf(f)) << b;
    nans += std::isnan(f) ? 1 : 0;
  }
  EXPECT_EQ(nans, 2);
}

TEST(DTypeTest, Fp8EncodeHandValues) {
  EXPECT_EQ(f32_to_fp8e4m3(0.0f), 0x00);
  EXPECT_EQ(f32_to_fp8e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_fp8e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_fp8e4m3(-1.0f), 0xb8);
  EXPECT_EQ(f32_to_fp8e4m3(1.5f), 0x3c);
  EXPECT_EQ(f32_to_fp8e4m3(240.0f), 0x77);
  EXPECT_EQ(f32_to_fp8e4m3(448.0f), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(-448.0f), 0xfe);
  // Ties to even: 1 + 1/16 is halfway between 0x38 (even) and 0x39.
  EXPECT_EQ(f32_to_fp8e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_fp8e4m3(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(f32_to_fp8e4m3(1.1875f), 0x3a);   // halfway 0x39 / 0x3a
  EXPECT_EQ(f32_to_fp8e4m3(-1.1875f), 0xba);
  EXPECT_EQ(f32_to_fp8e4m3(1.9375f), 0x40);   // halfway 1.875 (0x3f) / 2.0 (0x40): carries into the exponent
  EXPECT_EQ(f32_to_fp8e4m3(std::nextafter(1.9375f, 0.0f)), 0x3f);
  EXPECT_EQ(f32_to_fp8e4m3(432.0f), 0x7e);    // halfway 416 (0x7d) / 448 (0x7e)
  EXPECT_EQ(f32_to_fp8e4m3(424.0f), 0x7d);    // below that midpoint: 416
  EXPECT_EQ(f32_to_fp8e4m3(1.3f), 0x3a);      // 1.3 -> 1.25
  EXPECT_EQ(f32_to_fp8e4m3(0.3f), 0x2a);      // 0.3 = 1.2 * 2^-2 -> 1.25 * 2^-2 (exp 5, mant 2)
  // Saturation to +-448 (no infinities in e4m3fn).
  EXPECT_EQ(f32_to_fp8e4m3(449.0f), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(464.0f), 0x7e);  // halfway to the absent 480
  EXPECT_EQ(f32_to_fp8e4m3(500.0f), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(1e9f), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(-1e9f), 0xfe);
  EXPECT_EQ(f32_to_fp8e4m3(kInf), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(-kInf), 0xfe);
  // NaN.
  EXPECT_EQ(f32_to_fp8e4m3(kNaN) & 0x7f, 0x7f);
  // Subnormals: multiples of 2^-9, ties to even.
  EXPECT_EQ(f32_to_fp8e4m3(std::ldexp(1.0f, -9)), 0x01);
  EXPECT_EQ(f32_to_fp8e4m3(-std::ldexp(1.0f, -9)), 0x81);
  EXPECT_EQ(f32_to_fp8e4m3(std::ldexp(1.0f, -10)), 0x00);  // halfway 0 / 1 -> 0
  EXPECT_EQ(f32_to_fp8e4m3(std::ldexp(3.0f, -10)), 0x02);  // halfway 1 / 2 -> 2
  EXPECT_EQ(f32_to_fp8e4m3(std::ldexp(5.0f, -10)), 0x02);  // halfway 2 / 3 -> 2
  EXPECT_EQ(f32_to_fp8e4m3(std::ldexp(1.25f, -9)), 0x01);
  EXPECT_EQ(f32_to_fp8e4m3(std::ldexp(7.0f, -9)), 0x07);
  EXPECT_EQ(f32_to_fp8e4m3(std::ldexp(7.5f, -9)), 0x08);   // halfway 7 / smallest normal -> 0x08
  EXPECT_EQ(f32_to_fp8e4m3(std::ldexp(1.0f, -6)), 0x08);
  EXPECT_EQ(f32_to_fp8e4m3(1e-10f), 0x00);
  EXPECT_EQ(f32_to_fp8e4m3(-1e-10f), 0x80);
}

TEST(DTypeTest, Fp8RoundTripOfEveryByte) {
  for (int b = 0; b < 256; ++b) {
    if (b == 0x7f || b == 0xff) continue;
    const uint8_t v = static_cast<uint8_t>(b);
    ASSERT_EQ(f32_to_fp8e4m3(fp8e4m3_to_f32(v)), v) << b;
  }
}

TEST(DTypeTest, Fp8EncodeIsNearestTiesToEven) {
  // Brute force: the nearest of the 127 non-negative finite values, ties to
  // the even byte (the encoding is monotonic, so "even mantissa" is an even
  // byte across exponent boundaries too); at or past 448, 448.
  auto brute = [](float x) -> uint8_t {
    const float a = std::fabs(x);
    uint8_t best = 0x7e;
    if (a < 448.0f) {
      float best_d = kInf;
      for (int b = 0; b <= 0x7e; ++b) {
        const float d = std::fabs(fp8e4m3_to_f32(static_cast<uint8_t>(b)) - a);
        if (d < best_d || (d == best_d && (b & 1) == 0)) {
          best_d = d;
          best = static_cast<uint8_t>(b);
        }
      }
    }
    return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
  };
  std::vector<float> xs;
  for (int b = 0; b < 0x7e; ++b) {
    const float lo = fp8e4m3_to_f32(static_cast<uint8_t>(b)), hi = fp8e4m3_to_f32(static_cast<uint8_t>(b + 1));
    const float mid = (lo + hi) / 2;
    for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInf), lo + (hi - lo) / 3,
                    hi - (hi - lo) / 5})
      xs.push_back(x);
  }
  for (float x = 400.0f; x < 520.0f; x += 0.75f) xs.push_back(x);
  for (float x : xs) {
    ASSERT_EQ(f32_to_fp8e4m3(x), brute(x)) << x;
    ASSERT_EQ(f32_to_fp8e4m3(-x), brute(-x)) << -x;
  }
}

// ---------------------------------------------------------------- e8m0

TEST(DTypeTest, E8M0) {
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(128), 2.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(e8m0_to_f32(126), 0.5f);
  EXPECT_EQ(e8m0_to_f32(120), 1.0f / 128.0f);
  EXPECT_EQ(e8m0_to_f32(254), std::ldexp(1.0f, 127));
  EXPECT_EQ(bits_of(e8m0_to_f32(254)), 0x7f000000u);
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(bits_of(e8m0_to_f32(0)), 0x00400000u);  // 2^-127 is an f32 subnormal
  EXPECT_EQ(bits_of(e8m0_to_f32(1)), 0x00800000u);  // 2^-126: smallest normal
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
}

// ---------------------------------------------------------------- dtype table and bulk conversion

TEST(DTypeTest, NamesSizesAndParsing) {
  struct Case {
    DType d;
    const char* name;
    size_t size;
  };
  for (const Case& c : {Case{DType::kF32, "F32", 4}, Case{DType::kBF16, "BF16", 2}, Case{DType::kF16, "F16", 2},
                        Case{DType::kF8E4M3, "F8_E4M3", 1}, Case{DType::kU8, "U8", 1}, Case{DType::kI32, "I32", 4},
                        Case{DType::kI64, "I64", 8}}) {
    EXPECT_STREQ(dtype_name(c.d), c.name);
    EXPECT_EQ(dtype_size(c.d), c.size);
    auto p = parse_safetensors_dtype(c.name);
    ASSERT_TRUE(p.ok()) << c.name;
    EXPECT_EQ(*p, c.d);
  }
  for (const char* bad : {"F64", "f32", "BOOL", "F8_E5M2", ""}) {
    auto p = parse_safetensors_dtype(bad);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(p.status().message().find(std::string("'") + bad + "'"), std::string::npos) << p.status().message();
  }
}

TEST(DTypeTest, ConvertToF32) {
  float out[4];
  const float f32[4] = {1.5f, -2.0f, 0.0f, 1e-3f};
  convert_to_f32(f32, DType::kF32, out, 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], f32[i]);
  const uint16_t bf16[4] = {0x3f80, 0xc000, 0x4049, 0x0000};
  convert_to_f32(bf16, DType::kBF16, out, 4);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], 3.140625f);
  EXPECT_EQ(out[3], 0.0f);
  const uint16_t f16[4] = {0x3c00, 0xc000, 0x0001, 0x7bff};
  convert_to_f32(f16, DType::kF16, out, 4);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(out[3], 65504.0f);
  const uint8_t fp8[4] = {0x38, 0xfe, 0x01, 0x44};
  convert_to_f32(fp8, DType::kF8E4M3, out, 4);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -448.0f);
  EXPECT_EQ(out[2], std::ldexp(1.0f, -9));
  EXPECT_EQ(out[3], 3.0f);
  const uint8_t u8[4] = {0, 1, 127, 255};
  convert_to_f32(u8, DType::kU8, out, 4);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 1.0f);
  EXPECT_EQ(out[2], 127.0f);
  EXPECT_EQ(out[3], 255.0f);
  const int32_t i32[4] = {0, -7, 1 << 20, 42};
  convert_to_f32(i32, DType::kI32, out, 4);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], -7.0f);
  EXPECT_EQ(out[2], 1048576.0f);
  EXPECT_EQ(out[3], 42.0f);
}

// ---------------------------------------------------------------- FP8 block dequantization

TEST(DTypeTest, DequantizeFp8BlockRefPartialBlocks) {
  // n = 5, k = 7, blocks of 2 rows x 3 columns: scale_inv is [3, 3]; the last
  // row block holds one row and the last column block one column.
  constexpr int64_t n = 5, k = 7;
  const uint8_t q[n * k] = {
      0x38, 0x40, 0xb8, 0x3c, 0x30, 0x00, 0x38,  //  1    2   -1   1.5  0.5  0    1
      0x40, 0x38, 0x38, 0xc0, 0x3c, 0x38, 0xb0,  //  2    1    1  -2    1.5  1   -0.5
      0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38,  //  1 ...
      0x3c, 0x40, 0x30, 0xb8, 0x38, 0x40, 0x44,  //  1.5  2   0.5 -1    1    2    3
      0x01, 0x08, 0x7e, 0x38, 0x40, 0x38, 0xb8,  //  2^-9 2^-6 448 1    2    1   -1
  };
  const float scale_inv[3 * 3] = {
      1.0f,  2.0f,  4.0f,     // rows 0-1: cols 0-2, 3-5, 6
      0.5f,  3.0f,  -1.0f,    // rows 2-3
      10.0f, 0.25f, 1024.0f,  // row 4
  };
  const float expect[n * k] = {
      1.0f,        2.0f,     -1.0f,   3.0f,  1.0f, 0.0f,  4.0f,      //
      2.0f,        1.0f,     1.0f,    -4.0f, 3.0f, 2.0f,  -2.0f,     //
      0.5f,        0.5f,     0.5f,    3.0f,  3.0f, 3.0f,  -1.0f,     //
      0.75f,       1.0f,     0.25f,   -3.0f, 3.0f, 6.0f,  -3.0f,     //
      0.01953125f, 0.15625f, 4480.0f, 0.25f, 0.5f, 0.25f, -1024.0f,  //
  };
  float out[n * k];
  for (float& o : out) o = kNaN;
  kernels::dequantize_fp8_block_ref(q, scale_inv, n, k, /*block_n=*/2, /*block_k=*/3, out);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) EXPECT_EQ(out[i * k + j], expect[i * k + j]) << "at [" << i << ", " << j << "]";
}

TEST(DTypeTest, DequantizeFp8BlockRefOneBlock) {
  // Blocks larger than the matrix: one scale for everything.
  const uint8_t q[6] = {0x38, 0x40, 0x44, 0xb8, 0x30, 0x00};
  const float scale = 0.125f;
  float out[6];
  kernels::dequantize_fp8_block_ref(q, &scale, 2, 3, 128, 128, out);
  const float expect[6] = {0.125f, 0.25f, 0.375f, -0.125f, 0.0625f, 0.0f};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], expect[i]) << i;
}

}  // namespace
}  // namespace nucleus
