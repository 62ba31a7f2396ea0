// The skinny decode GEMM choice (ops/skinny.h) under the default switch: the
// measured rule at the DeepSeek decode shapes it was measured on, and never
// more rows than the kernel takes.
#include <gtest/gtest.h>

#include <utility>

#include "ops/skinny.h"

namespace nucleus {
namespace {

TEST(SkinnyRule, DefaultIsTheMeasuredRule) {
  ASSERT_TRUE(skinny_env_status().ok()) << "the test runs without NUCLEUS_SKINNY";
  EXPECT_EQ(skinny_switch(), SkinnySwitch::kAuto);
  struct Case {
    int64_t n, k, rows;
    const char* what;
  };
  for (const Case& c : {Case{576, 2048, 8, "V2-Lite kv_a"}, Case{64, 2048, 8, "V2-Lite router"},
                        Case{2048, 2048, 4, "V2-Lite o_proj"}, Case{2048, 1408 * 2, 4, "V2-Lite shared down"},
                        Case{3072, 2048, 2, "V2-Lite q_proj"}, Case{5632, 2048, 1, "V2-Lite shared gate_up"},
                        Case{2048, 10944, 2, "V2-Lite dense down"}, Case{21888, 2048, 0, "V2-Lite dense gate_up"},
                        Case{102400, 2048, 2, "V2-Lite lm_head"}, Case{576, 7168, 4, "V3 kv_a"},
                        Case{256, 7168, 4, "V3 router"}, Case{1536, 7168, 2, "V3 q_a"},
                        Case{24576, 1536, 0, "V3 q_b"}, Case{7168, 16384, 0, "V3 o_proj"},
                        Case{7168, 2048, 1, "V3 shared down"}, Case{129280, 7168, 2, "V3 lm_head"}})
    EXPECT_EQ(skinny_max_rows(c.n, c.k), c.rows) << c.what;
  for (int64_t n : {1, 100, 1024, 1025, 2048, 4096, 4097, 8192, 100000})
    for (int64_t k : {8, 2048, 4096, 7168, 65536}) {
      EXPECT_GE(skinny_max_rows(n, k), 0);
      EXPECT_LE(skinny_max_rows(n, k), 8) << "the kernel takes m <= 8";
    }
}

// The FP8 skinny GEMM choice under the default switch, by weight bytes as
// measured on the H200 (ops/skinny.h): every m <= 16 up to 16 MB (q_a, kv_a,
// shared down, TP 8 shards), m <= 8 up to 48 MB (q_b, shared gate_up), m = 1
// above (o_proj, dense MLP), in the stream scheme, which auto runs at m = 1 on
// every shape of 2 MiB and more the skinny kernel takes and never at m = 2;
// none whose k is not whole 128-wide scale blocks
// (the kernel refuses them: tiny-dsv3-fp8's shared down_proj, k = 192), never
// more than 16 rows.
TEST(SkinnyRule, Fp8DefaultByWeightBytes) {
  ASSERT_TRUE(skinny_env_status().ok()) << "the test runs without NUCLEUS_SKINNY_FP8";
  EXPECT_EQ(skinny_fp8_switch(), SkinnySwitch::kAuto);
  for (auto [n, k] : {std::pair<int64_t, int64_t>{1536, 7168}, {576, 7168}, {7168, 2048}, {7168, 256}, {7168, 2304},
                      {7168, 1024}, {3072, 1536}})
    EXPECT_EQ(skinny_fp8_max_rows(n, k), 16) << n << " x " << k;
  for (auto [n, k] : {std::pair<int64_t, int64_t>{24576, 1536}, {4096, 7168}})
    EXPECT_EQ(skinny_fp8_max_rows(n, k), 8) << n << " x " << k;
  for (auto [n, k] : {std::pair<int64_t, int64_t>{7168, 16384}, {36864, 7168}, {7168, 18432}}) {
    EXPECT_EQ(skinny_fp8_stream_switch(), SkinnySwitch::kAuto);
    EXPECT_EQ(skinny_fp8_max_rows(n, k), 1) << n << " x " << k;
    EXPECT_TRUE(skinny_fp8_stream(1, n, k)) << n << " x " << k;
    EXPECT_FALSE(skinny_fp8_stream(2, n, k)) << n << " x " << k;
  }
  for (auto [n, k] : {std::pair<int64_t, int64_t>{1536, 7168}, {24576, 1536}, {4096, 7168}})
    EXPECT_TRUE(skinny_fp8_stream(1, n, k) && !skinny_fp8_stream(2, n, k)) << n << " x " << k;
  EXPECT_FALSE(skinny_fp8_stream(1, 7168, 1000)) << "7.2 MB, but k is not whole 128-wide blocks: not taken";
  EXPECT_FALSE(skinny_fp8_stream(1, 7168, 256)) << "1.8 MB (V3 TP 8 shared down_proj): below 2 MiB";
  EXPECT_TRUE(skinny_fp8_stream(1, 1536, 1536)) << "2.4 MB (Kimi-K2 TP 8 q_b)";
  for (auto [n, k] : {std::pair<int64_t, int64_t>{256, 192}, {300, 200}, {1536, 64}, {128, 0}, {0, 1024}})
    EXPECT_EQ(skinny_fp8_max_rows(n, k), 0) << n << " x " << k;
  for (int64_t n : {1, 8, 100, 7168, 129280})
    for (int64_t k : {128, 200, 7168, 16384}) {
      EXPECT_GE(skinny_fp8_max_rows(n, k), 0);
      EXPECT_LE(skinny_fp8_max_rows(n, k), kSkinnyFp8MaxRows) << "the kernel takes m <= 16";
    }
}

}  // namespace
}  // namespace nucleus
