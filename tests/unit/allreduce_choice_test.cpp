// The fused all-reduce + RMSNorm choice (ops/allreduce_choice.h) follows the
// H200 measurement at 2 ranks and the byte limits elsewhere.
#include <gtest/gtest.h>

#include "ops/allreduce_choice.h"

namespace nucleus {
namespace {

int64_t bf16_bytes(int64_t rows, int64_t width) { return rows * width * 2; }

TEST(FusedAllReduceChoice, TwoRanksHidden2048FusesUpToOneMiB) {
  for (int64_t rows : {1, 16, 32, 128, 256})
    EXPECT_TRUE(fused_allreduce_chosen(2, rows, 2048, bf16_bytes(rows, 2048))) << rows;  // 1.00-1.16x measured
  EXPECT_FALSE(fused_allreduce_chosen(2, 512, 2048, bf16_bytes(512, 2048)));              // 2 MiB
  EXPECT_TRUE(fused_allreduce_chosen(2, 128, 2048, 128 * 2048 * 4));                      // f32 delta, 1 MiB
}

TEST(FusedAllReduceChoice, TwoRanksHidden7168OnlyFromSixtyFourRows) {
  for (int64_t rows : {1, 2, 4, 8, 16, 32, 63})  // 0.77-0.90x measured up to 32 rows
    EXPECT_FALSE(fused_allreduce_chosen(2, rows, 7168, bf16_bytes(rows, 7168))) << rows;
  EXPECT_TRUE(fused_allreduce_chosen(2, 64, 7168, bf16_bytes(64, 7168)));    // 1.03x
  EXPECT_TRUE(fused_allreduce_chosen(2, 128, 7168, bf16_bytes(128, 7168)));  // 1.29x, 1.75 MiB
  EXPECT_FALSE(fused_allreduce_chosen(2, 512, 7168, bf16_bytes(512, 7168))); // 7 MiB: NCCL
}

TEST(FusedAllReduceChoice, MoreRanksKeepTheByteLimits) {
  EXPECT_TRUE(fused_allreduce_chosen(4, 1, 7168, 512 << 10));
  EXPECT_FALSE(fused_allreduce_chosen(4, 1, 7168, (512 << 10) + 1));
  EXPECT_TRUE(fused_allreduce_chosen(8, 1, 7168, 256 << 10));
  EXPECT_FALSE(fused_allreduce_chosen(8, 1, 7168, (256 << 10) + 1));
}

TEST(FusedAllReduceChoice, TheOverrideIsAByteLimitAlone) {
  EXPECT_TRUE(fused_allreduce_chosen(2, 1, 7168, bf16_bytes(1, 7168), 1 << 20));
  EXPECT_FALSE(fused_allreduce_chosen(2, 128, 2048, bf16_bytes(128, 2048), 0));
}

}  // namespace
}  // namespace nucleus
