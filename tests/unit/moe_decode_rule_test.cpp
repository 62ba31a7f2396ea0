// The MoE decode kernel's switch (ops/moe_decode.h) under the default: auto,
// steps of up to 16 tokens, within what the kernel takes. (Malformed values:
// cli_test's BadFlagsAndFilesAreErrorsNamingTheProblem; on and off end to
// end: gpu_skinny_switch_test.)
#include <gtest/gtest.h>

#include "ops/moe_decode.h"

namespace nucleus {
namespace {

TEST(MoeDecodeRule, DefaultIsAutoUpToSixteenTokens) {
  ASSERT_TRUE(moe_decode_env_status().ok()) << "the test runs without NUCLEUS_MOE_DECODE";
  EXPECT_EQ(moe_decode_max_tokens(), 0) << "auto: off (measured slower than cuda_grouped, ops/moe_decode.h)";
  EXPECT_EQ(kMoeDecodeAutoMaxTokens, 0);
  EXPECT_LE(kMoeDecodeAutoMaxTokens, kMoeDecodeKernelMaxTokens) << "auto never asks for more than the kernel takes";
}

}  // namespace
}  // namespace nucleus
