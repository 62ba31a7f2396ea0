// The MoE decode kernel's switch (ops/moe_decode.h) under the default: auto,
// steps of up to 16 tokens, within what the kernel takes. (Malformed values:
// cli_test's BadFlagsAndFilesAreErrorsNamingTheProblem; on and off end to
// end: gpu_skinny_switch_test.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "ops/moe_decode.h"
#include "test_util.h"

namespace nucleus {
namespace {

TEST(MoeDecodeRule, DefaultIsAutoUpToSixteenTokens) {
  ASSERT_TRUE(moe_decode_env_status().ok()) << "the test runs without NUCLEUS_MOE_DECODE";
  EXPECT_EQ(moe_decode_max_tokens(), 0) << "auto: off (measured slower than cuda_grouped, ops/moe_decode.h)";
  EXPECT_EQ(kMoeDecodeAutoMaxTokens, 0);
  EXPECT_LE(kMoeDecodeAutoMaxTokens, kMoeDecodeKernelMaxTokens) << "auto never asks for more than the kernel takes";
}

// NUCLEUS_MOE_ALIGN_FREE, NUCLEUS_MOE_COMBINE_PREFETCH and NUCLEUS_MOE_ROUTE_REGS: on under auto (unset),
// 1 and its spellings; off under 0; a malformed value reads as on and is
// refused by the env check, which names the variable.
TEST(MoeDecodeRule, AutoOnSwitchValues) {
  struct Case {
    const char* name;
    bool (*read)();
  };
  for (const Case c : {Case{"NUCLEUS_MOE_ALIGN_FREE", moe_align_free_switch},
                       Case{"NUCLEUS_MOE_COMBINE_PREFETCH", moe_combine_prefetch_switch},
                       Case{"NUCLEUS_MOE_ROUTE_REGS", moe_route_regs_switch}}) {
    {
      testing::ScopedEnvValue unset(c.name, nullptr);
      EXPECT_TRUE(c.read()) << c.name << " unset: auto, on";
    }
    for (const char* v : {"", "auto", "AUTO", "1", "on", "True"}) {
      testing::ScopedEnvValue e(c.name, v);
      EXPECT_TRUE(moe_up_splits_env_status().ok()) << c.name << "='" << v << "'";
      EXPECT_TRUE(c.read()) << c.name << "='" << v << "'";
    }
    for (const char* v : {"0", "off", "FALSE"}) {
      testing::ScopedEnvValue e(c.name, v);
      EXPECT_TRUE(moe_up_splits_env_status().ok()) << c.name << "=" << v;
      EXPECT_FALSE(c.read()) << c.name << "=" << v;
    }
    for (const char* bad : {"2", "yes", " 1"}) {
      testing::ScopedEnvValue e(c.name, bad);
      const Status s = moe_up_splits_env_status();
      EXPECT_FALSE(s.ok()) << c.name << "='" << bad << "'";
      EXPECT_NE(s.message().find(std::string(c.name) + "='" + bad + "'"), std::string::npos) << s.message();
    }
  }
}

// The three-way switches read as kernels::MoeGroupedOptions fields
// (NUCLEUS_MOE_DEEP_RING, NUCLEUS_MOE_UP_STREAM, NUCLEUS_MOE_WGMMA,
// NUCLEUS_MOE_FP8_W8A8): -1 (the kernel's rule) unset and under auto, 1 under
// 1 and its spellings, 0 under 0 and its spellings; a malformed value reads as
// auto and is refused by the env check, which names the variable.
TEST(MoeDecodeRule, TriSwitchValues) {
  struct Case {
    const char* name;
    int (*read)();
  };
  for (const Case c : {Case{"NUCLEUS_MOE_DEEP_RING", moe_deep_ring_switch},
                       Case{"NUCLEUS_MOE_UP_STREAM", moe_up_stream_switch},
                       Case{"NUCLEUS_MOE_WGMMA", moe_wgmma_switch},
                       Case{"NUCLEUS_MOE_FP8_W8A8", moe_fp8_w8a8_switch}}) {
    {
      testing::ScopedEnvValue unset(c.name, nullptr);
      EXPECT_EQ(c.read(), -1) << c.name << " unset: auto";
    }
    for (const char* v : {"", "auto", "AUTO"}) {
      testing::ScopedEnvValue e(c.name, v);
      EXPECT_TRUE(moe_up_splits_env_status().ok()) << c.name << "='" << v << "'";
      EXPECT_EQ(c.read(), -1) << c.name << "='" << v << "'";
    }
    for (const char* v : {"1", "on", "True"}) {
      testing::ScopedEnvValue e(c.name, v);
      EXPECT_TRUE(moe_up_splits_env_status().ok()) << c.name << "=" << v;
      EXPECT_EQ(c.read(), 1) << c.name << "=" << v;
    }
    for (const char* v : {"0", "off", "FALSE"}) {
      testing::ScopedEnvValue e(c.name, v);
      EXPECT_TRUE(moe_up_splits_env_status().ok()) << c.name << "=" << v;
      EXPECT_EQ(c.read(), 0) << c.name << "=" << v;
    }
    for (const char* bad : {"2", "yes", " 1"}) {
      testing::ScopedEnvValue e(c.name, bad);
      const Status s = moe_up_splits_env_status();
      EXPECT_FALSE(s.ok()) << c.name << "='" << bad << "'";
      EXPECT_NE(s.message().find(std::string(c.name) + "='" + bad + "'"), std::string::npos) << s.message();
      EXPECT_EQ(c.read(), -1) << c.name << "='" << bad << "': read as auto until refused";
    }
  }
}

}  // namespace
}  // namespace nucleus
