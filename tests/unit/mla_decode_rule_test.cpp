// The decode attention switches of ops/mla_decode.h read on the CPU: the KV
// split minimum (NUCLEUS_MLA_DECODE_SPLIT_KEYS) by value, its auto rule, and
// the refusal of a malformed value naming it; the same for the CTAs a
// multiprocessor (NUCLEUS_MLA_DECODE_CTAS_PER_SM) and the key tile
// (NUCLEUS_MLA_DECODE_KEY_TILE). (That every setting computes the same
// attention: mla_decode_gpu_test SplitKeysSettingsAgree, TwoCtasPerSmMatchesOne,
// KeyTilesAgree.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "ops/mla_decode.h"
#include "test_util.h"

namespace nucleus {
namespace {

using ScopedEnv = testing::ScopedEnvValue;

TEST(MlaDecodeRule, SplitKeysValues) {
  for (const char* v : {"32", "64", "128", "96", "1024"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_SPLIT_KEYS", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << v;
    EXPECT_EQ(mla_decode_min_split_keys(1, 16), std::atoi(v)) << v;
    EXPECT_EQ(mla_decode_min_split_keys(64, 128), std::atoi(v)) << v;
  }
  for (const char* v : {"", "auto", "AUTO"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_SPLIT_KEYS", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << "'" << v << "'";
    for (int64_t rows : {1, 2, 8, 64})
      for (int64_t heads : {16, 128})
        EXPECT_EQ(mla_decode_min_split_keys(rows, heads), mla_decode_min_split_keys_auto(rows, heads));
  }
}

TEST(MlaDecodeRule, SplitKeysAutoRuleIsAKernelValue) {
  for (int64_t rows = 1; rows <= 512; rows *= 2)
    for (int64_t heads : {4, 16, 32, 64, 128}) {
      const int64_t k = mla_decode_min_split_keys_auto(rows, heads);
      EXPECT_TRUE(k == 0 || (k >= 32 && k <= 1024)) << "the device's plan (0) or a minimum the switch takes";
      EXPECT_EQ(k % 32, 0) << "a multiple of the 32-key tile";
    }
}

TEST(MlaDecodeRule, MalformedSplitKeysAreRefusedByName) {
  for (const char* bad : {"0", "16", "48", "2048", "-32", "64k", " 64", "on"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_SPLIT_KEYS", bad);
    const Status s = mla_decode_env_status();
    EXPECT_FALSE(s.ok()) << "'" << bad << "'";
    EXPECT_NE(s.message().find(std::string("NUCLEUS_MLA_DECODE_SPLIT_KEYS='") + bad + "'"), std::string::npos)
        << s.message();
    EXPECT_EQ(mla_decode_min_split_keys(1, 16), mla_decode_min_split_keys_auto(1, 16))
        << "a malformed value reads as auto until refused";
  }
}

TEST(MlaDecodeRule, CtasPerSmValues) {
  for (const char* v : {"1", "2"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_CTAS_PER_SM", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << v;
    EXPECT_EQ(mla_decode_ctas_per_sm(1, 16), std::atoi(v));
    EXPECT_EQ(mla_decode_ctas_per_sm(1, 128), 1) << "more than 16 heads a call: one CTA a multiprocessor";
  }
  for (const char* v : {"", "auto"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_CTAS_PER_SM", v);
    for (int64_t rows : {1, 8, 64, 256}) {
      EXPECT_EQ(mla_decode_ctas_per_sm(rows, 16), mla_decode_ctas_per_sm_auto(rows, 16));
      const int a = mla_decode_ctas_per_sm_auto(rows, 16);
      EXPECT_TRUE(a == 1 || a == 2) << a;
    }
  }
  for (const char* bad : {"0", "3", "two", " 2"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_CTAS_PER_SM", bad);
    const Status s = mla_decode_env_status();
    EXPECT_FALSE(s.ok()) << "'" << bad << "'";
    EXPECT_NE(s.message().find(std::string("NUCLEUS_MLA_DECODE_CTAS_PER_SM='") + bad + "'"), std::string::npos)
        << s.message();
  }
}

TEST(MlaDecodeRule, KeyTileValues) {
  for (const char* v : {"32", "64"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_KEY_TILE", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << v;
    EXPECT_EQ(mla_decode_key_tile(1, 16), std::atoi(v));
    EXPECT_EQ(mla_decode_key_tile(64, 4), std::atoi(v));
    EXPECT_EQ(mla_decode_key_tile(1, 128), 32) << "more than 16 heads a call: the 32-key kernel";
    ScopedEnv two("NUCLEUS_MLA_DECODE_CTAS_PER_SM", "2");
    EXPECT_EQ(mla_decode_key_tile(1, 16), 32) << "two CTAs a multiprocessor: the 32-key kernel";
  }
  for (const char* v : {"", "auto", "AUTO", "Auto"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_KEY_TILE", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << "'" << v << "'";
    for (int64_t rows : {1, 8, 64, 256})
      for (int64_t heads : {4, 16, 128}) {
        const int a = mla_decode_key_tile_auto(rows, heads);
        EXPECT_TRUE(a == 32 || a == 64) << a;
        EXPECT_EQ(mla_decode_key_tile(rows, heads), heads <= 16 ? a : 32);
      }
  }
  for (const char* bad : {"0", "16", "128", "sixty-four", " 64"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_KEY_TILE", bad);
    const Status s = mla_decode_env_status();
    EXPECT_FALSE(s.ok()) << "'" << bad << "'";
    EXPECT_NE(s.message().find(std::string("NUCLEUS_MLA_DECODE_KEY_TILE='") + bad + "'"), std::string::npos)
        << s.message();
    EXPECT_EQ(mla_decode_key_tile(1, 16), mla_decode_key_tile_auto(1, 16)) << "a malformed value reads as auto";
  }
}

TEST(MlaDecodeRule, BulkLoadsValues) {
  EXPECT_TRUE(mla_decode_bulk_loads_auto(1, 16, KvCacheDtype::kBF16));
  EXPECT_TRUE(mla_decode_bulk_loads_auto(1, 16, KvCacheDtype::kFp8DsMla));
  EXPECT_FALSE(mla_decode_bulk_loads_auto(1, 16, KvCacheDtype::kFp8E4M3)) << "measured slower on few e4m3 rows";
  EXPECT_FALSE(mla_decode_bulk_loads_auto(31, 16, KvCacheDtype::kFp8E4M3));
  EXPECT_TRUE(mla_decode_bulk_loads_auto(32, 16, KvCacheDtype::kFp8E4M3)) << "measured faster from 32 e4m3 rows";
  EXPECT_TRUE(mla_decode_bulk_loads_auto(128, 16, KvCacheDtype::kFp8E4M3));
  for (const char* v : {"0", "off", "FALSE"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_BULK_LOADS", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << v;
    EXPECT_FALSE(mla_decode_bulk_loads(1, 16, KvCacheDtype::kBF16)) << v;
  }
  for (const char* v : {"1", "on", "True"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_BULK_LOADS", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << v;
    EXPECT_TRUE(mla_decode_bulk_loads(128, 16, KvCacheDtype::kFp8E4M3)) << v;
  }
  for (const char* v : {"", "auto", "AUTO"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_BULK_LOADS", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << "'" << v << "'";
    for (int64_t rows : {1, 8, 64, 256})
      for (KvCacheDtype d : {KvCacheDtype::kBF16, KvCacheDtype::kFp8E4M3, KvCacheDtype::kFp8DsMla})
        EXPECT_EQ(mla_decode_bulk_loads(rows, 16, d), mla_decode_bulk_loads_auto(rows, 16, d)) << rows;
  }
  for (const char* bad : {"2", "yes", "bulk", " 1"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_BULK_LOADS", bad);
    const Status s = mla_decode_env_status();
    EXPECT_FALSE(s.ok()) << "'" << bad << "'";
    EXPECT_NE(s.message().find(std::string("NUCLEUS_MLA_DECODE_BULK_LOADS='") + bad + "'"), std::string::npos)
        << s.message();
    EXPECT_EQ(mla_decode_bulk_loads(1, 16, KvCacheDtype::kBF16), mla_decode_bulk_loads_auto(1, 16, KvCacheDtype::kBF16))
        << "a malformed value reads as auto";
  }
}

// NUCLEUS_MLA_DECODE_WGMMA: the 64-head wgmma kernel applies at multiples of
// 64 heads, on bf16, fp8_e4m3 and fp8_ds_mla caches, never on an f32 one
// (worked out by hand: V3 / R1 / Kimi-K2 at TP 1 and 2 have 128 and 64 heads;
// V2-Lite 16; TP 4 of V3 32), whatever the switch.
TEST(MlaDecodeRule, WgmmaValues) {
  using D = KvCacheDtype;
  for (D d : {D::kBF16, D::kFp8E4M3, D::kFp8DsMla}) {
    for (int64_t heads : {64, 128, 256}) EXPECT_TRUE(mla_decode_wgmma_applies(heads, d)) << heads;
    for (int64_t heads : {0, 4, 16, 32, 96, 48}) EXPECT_FALSE(mla_decode_wgmma_applies(heads, d)) << heads;
  }
  EXPECT_FALSE(mla_decode_wgmma_applies(128, D::kF32));
  for (const char* v : {"0", "off", "False"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_WGMMA", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << v;
    EXPECT_FALSE(mla_decode_wgmma(1, 128, D::kBF16)) << v;
  }
  for (const char* v : {"1", "on", "TRUE"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_WGMMA", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << v;
    EXPECT_TRUE(mla_decode_wgmma(1, 128, D::kBF16)) << v;
    EXPECT_TRUE(mla_decode_wgmma(300, 64, D::kBF16)) << v;
    EXPECT_FALSE(mla_decode_wgmma(1, 16, D::kBF16)) << v << ": 16 heads, not where it applies";
    EXPECT_TRUE(mla_decode_wgmma(1, 128, D::kFp8E4M3)) << v;
    EXPECT_TRUE(mla_decode_wgmma(64, 64, D::kFp8DsMla)) << v;
    EXPECT_FALSE(mla_decode_wgmma(1, 128, D::kF32)) << v << ": an f32 cache, not where it applies";
  }
  for (const char* v : {"", "auto", "Auto"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_WGMMA", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << "'" << v << "'";
    for (int64_t rows : {1, 8, 64, 256})
      for (int64_t heads : {16, 32, 64, 128})
        for (D d : {D::kBF16, D::kFp8E4M3, D::kFp8DsMla})
          EXPECT_EQ(mla_decode_wgmma(rows, heads, d),
                    mla_decode_wgmma_applies(heads, d) && mla_decode_wgmma_auto(rows, heads, d))
              << rows << " rows " << heads << " heads";
  }
  for (const char* bad : {"2", "yes", "wgmma", " 1"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_WGMMA", bad);
    const Status s = mla_decode_env_status();
    EXPECT_FALSE(s.ok()) << "'" << bad << "'";
    EXPECT_NE(s.message().find(std::string("NUCLEUS_MLA_DECODE_WGMMA='") + bad + "'"), std::string::npos)
        << s.message();
  }
}

TEST(MlaDecodeRule, Fp8RegisterConvertValues) {
  for (int64_t rows : {1, 8, 32, 63, 64, 128, 512}) {
    EXPECT_TRUE(mla_decode_fp8_register_convert_auto(rows, KvCacheDtype::kFp8E4M3)) << rows;
    EXPECT_FALSE(mla_decode_fp8_register_convert_auto(rows, KvCacheDtype::kBF16)) << rows;
    EXPECT_EQ(mla_decode_fp8_register_convert_auto(rows, KvCacheDtype::kFp8DsMla), rows >= 64)
        << rows << ": fp8_ds_mla measured slower below 64 rows";
  }
  for (const char* v : {"0", "off", "FALSE"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << v;
    EXPECT_FALSE(mla_decode_fp8_register_convert(128, KvCacheDtype::kFp8E4M3)) << v;
    EXPECT_FALSE(mla_decode_fp8_register_convert(128, KvCacheDtype::kFp8DsMla)) << v;
  }
  for (const char* v : {"1", "on", "True"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << v;
    EXPECT_TRUE(mla_decode_fp8_register_convert(1, KvCacheDtype::kFp8E4M3)) << v;
    EXPECT_TRUE(mla_decode_fp8_register_convert(1, KvCacheDtype::kFp8DsMla)) << v;
    EXPECT_FALSE(mla_decode_fp8_register_convert(128, KvCacheDtype::kBF16)) << v << ": FP8 rows only";
  }
  for (const char* v : {"", "auto", "AUTO"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT", v);
    EXPECT_TRUE(mla_decode_env_status().ok()) << "'" << v << "'";
    for (int64_t rows : {1, 64})
      for (KvCacheDtype d : {KvCacheDtype::kBF16, KvCacheDtype::kFp8E4M3, KvCacheDtype::kFp8DsMla})
        EXPECT_EQ(mla_decode_fp8_register_convert(rows, d), mla_decode_fp8_register_convert_auto(rows, d));
  }
  for (const char* bad : {"2", "yes", "reg", " 1"}) {
    ScopedEnv e("NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT", bad);
    const Status s = mla_decode_env_status();
    EXPECT_FALSE(s.ok()) << "'" << bad << "'";
    EXPECT_NE(s.message().find(std::string("NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT='") + bad + "'"),
              std::string::npos)
        << s.message();
    EXPECT_EQ(mla_decode_fp8_register_convert(1, KvCacheDtype::kFp8DsMla),
              mla_decode_fp8_register_convert_auto(1, KvCacheDtype::kFp8DsMla))
        << "a malformed value reads as auto";
  }
}

}  // namespace
}  // namespace nucleus
