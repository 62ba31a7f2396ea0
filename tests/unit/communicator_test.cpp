// The in-process communicator and the rank threads of a TpGroup: all-reduce
// (f32 and bf16, in place and not), all-gather and broadcast against values
// worked out by hand at 1-4 ranks; identical bits on every rank; errors
// (dtype, root); and a failing rank aborting the group instead of hanging
// the ranks that wait for it in a collective.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "comm/inprocess_communicator.h"
#include "comm/nccl_communicator.h"
#include "comm/tp_group.h"

namespace nucleus {
namespace {

// Runs fn(rank) on `world` threads of a CPU group; returns each rank's status.
std::vector<Status> on_ranks(int world, const std::function<Status(Communicator&, int)>& fn) {
  auto comms = make_inprocess_communicators(world);
  NUCLEUS_CHECK(comms.ok(), "{}", comms.status().to_string());
  std::vector<Status> out(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { out[r] = fn(*(*comms)[r], r); });
  for (auto& t : threads) t.join();
  return out;
}

TEST(InProcessCommunicatorTest, AllReduceSumsInRankOrderOnEveryRank) {
  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const int64_t count = 37;  // not a multiple of the world size: ragged reduce-scatter
    std::vector<std::vector<float>> got(world);
    auto st = on_ranks(world, [&](Communicator& c, int r) -> Status {
      EXPECT_EQ(c.rank(), r);
      EXPECT_EQ(c.world_size(), world);
      EXPECT_STREQ(c.backend(), "inprocess");
      std::vector<float> buf(count);
      for (int64_t i = 0; i < count; ++i) buf[i] = static_cast<float>((r + 1) * 1000 + i) + 0.25f * r;
      for (int rep = 0; rep < 3; ++rep) {  // repeated calls reuse the shared state
        std::vector<float> in = buf;
        NUCLEUS_RETURN_IF_ERROR(c.all_reduce_sum(in.data(), in.data(), count, DType::kF32, nullptr));
        got[r] = in;
      }
      return ok_status();
    });
    for (const auto& s : st) ASSERT_TRUE(s.ok()) << s.to_string();
    for (int64_t i = 0; i < count; ++i) {
      float want = 0.0f;
      for (int r = 0; r < world; ++r) want += static_cast<float>((r + 1) * 1000 + i) + 0.25f * r;
      for (int r = 0; r < world; ++r) ASSERT_EQ(got[r][i], want) << "rank " << r << " [" << i << "]";
    }
  }
}

TEST(InProcessCommunicatorTest, Bf16AllReduceOutOfPlaceRoundsTheF32Sum) {
  const int world = 3;
  std::vector<std::vector<uint16_t>> got(world);
  // 1 + 2^-8 + 2^-8 = 1 + 2^-7 exactly in f32; bf16 keeps 7 fraction bits, so
  // the sum of three bf16 values 1, 2^-8, 2^-8 summed in f32 is 1 + 2^-7,
  // where pairwise bf16 sums would lose both small terms (1 + 2^-8 rounds to 1).
  const float vals[3] = {1.0f, 1.0f / 256, 1.0f / 256};
  auto st = on_ranks(world, [&](Communicator& c, int r) -> Status {
    const uint16_t send = f32_to_bf16(vals[r]);
    uint16_t recv = 0xffff;
    NUCLEUS_RETURN_IF_ERROR(c.all_reduce_sum(&send, &recv, 1, DType::kBF16, nullptr));
    got[r] = {send, recv};
    return ok_status();
  });
  for (const auto& s : st) ASSERT_TRUE(s.ok()) << s.to_string();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(got[r][0], f32_to_bf16(vals[r])) << "send buffer untouched";
    EXPECT_EQ(bf16_to_f32(got[r][1]), 1.0f + 1.0f / 128) << "rank " << r;
  }
}

TEST(InProcessCommunicatorTest, AllGatherIsRankMajorAndBroadcastCopiesTheRoot) {
  const int world = 4;
  std::vector<std::vector<int32_t>> gathered(world), bcast(world);
  auto st = on_ranks(world, [&](Communicator& c, int r) -> Status {
    std::vector<int32_t> send = {10 * r, 10 * r + 1};
    gathered[r].assign(2 * world, -1);
    NUCLEUS_RETURN_IF_ERROR(c.all_gather(send.data(), gathered[r].data(), 2, DType::kI32, nullptr));
    bcast[r] = {r, r, r};
    return c.broadcast(bcast[r].data(), 3, DType::kI32, /*root=*/2, nullptr);
  });
  for (const auto& s : st) ASSERT_TRUE(s.ok()) << s.to_string();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(gathered[r], (std::vector<int32_t>{0, 1, 10, 11, 20, 21, 30, 31})) << r;
    EXPECT_EQ(bcast[r], (std::vector<int32_t>{2, 2, 2})) << r;
  }
}

TEST(InProcessCommunicatorTest, BadArgumentsAreErrors) {
  auto st = on_ranks(1, [](Communicator& c, int) -> Status {
    int32_t x = 1;
    Status s = c.all_reduce_sum(&x, &x, 1, DType::kI32, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.to_string();
    Status b = c.broadcast(&x, 1, DType::kI32, 1, nullptr);
    EXPECT_EQ(b.code(), StatusCode::kInvalidArgument) << b.to_string();
    return ok_status();
  });
  EXPECT_TRUE(st[0].ok());
  EXPECT_FALSE(make_inprocess_communicators(0).ok());
}

TEST(TpGroupTest, RunsEveryRankOnItsOwnThreadAndReportsTheLowestFailingRank) {
  auto g = TpGroup::create(3, Device::kCpu);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  std::vector<std::thread::id> ids(3);
  ASSERT_TRUE((*g)->run([&](int r) {
                    ids[r] = std::this_thread::get_id();
                    return ok_status();
                  })
                  .ok());
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_NE(ids[1], ids[2]);
  EXPECT_NE(ids[0], std::this_thread::get_id());
  // The same thread serves a rank on every run.
  ASSERT_TRUE((*g)->run([&](int r) {
                    EXPECT_EQ(ids[r], std::this_thread::get_id());
                    return ok_status();
                  })
                  .ok());
  // A rank that fails while the others wait for it in an all-reduce: the
  // others' collective returns an abort error, and run() reports rank 1's.
  Status s = (*g)->run([&](int r) -> Status {
    if (r == 1) return invalid_argument("boom");
    float x = 1.0f;
    Status c = (*g)->comm(r).all_reduce_sum(&x, &x, 1, DType::kF32, nullptr);
    EXPECT_EQ(c.code(), StatusCode::kAborted) << c.to_string();
    return c;
  });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();  // the cause, not the aborts
  EXPECT_NE(s.to_string().find("rank 1"), std::string::npos) << s.to_string();
  EXPECT_NE(s.to_string().find("boom"), std::string::npos) << s.to_string();
}

TEST(TpGroupTest, RefusesSizesOutsideOneToEight) {
  EXPECT_EQ(TpGroup::create(0, Device::kCpu).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(TpGroup::create(9, Device::kCpu).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(TpGroup::create(2, Device::kCpu).value()->make_peer_buffers(64).ok());
}

TEST(NcclLoaderTest, ExplicitLibraryPathThatDoesNotLoadIsNamed) {
  // Only meaningful where the loader has not run yet in this process; the
  // message must name the variable and the path either way.
  setenv("NUCLEUS_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
  auto d = nccl_library_description();
  unsetenv("NUCLEUS_NCCL_LIBRARY");
  ASSERT_FALSE(d.ok());
#ifdef NUCLEUS_HAVE_CUDA
  EXPECT_NE(d.status().message().find("NUCLEUS_NCCL_LIBRARY='/nonexistent/libnccl.so.2'"), std::string::npos)
      << d.status().to_string();
#else
  EXPECT_EQ(d.status().code(), StatusCode::kUnsupported);
#endif
}

}  // namespace
}  // namespace nucleus
