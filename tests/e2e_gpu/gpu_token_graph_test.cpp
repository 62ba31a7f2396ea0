// Prefill token graphs on tiny-dsv3 (buckets 16, 32, 64, 128): for step sizes
// just under, at and just over every bucket — mixed steps of a fresh prefill
// chunk plus three decode rows, so a pad of exactly one row happens too — a
// replayed step is bit-identical to the same padded step run eagerly
// (token_graph_eager_pad); its real rows equal the unpadded eager step within
// the bf16 tolerance below; and pad rows write no KV (a sentinel-filled pool
// keeps the sentinel outside the real rows).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>

#include "core/device.h"
#include "runtime/model_executor.h"
#include "test_util.h"

namespace nucleus {
namespace {

constexpr int64_t kBlockSize = 16, kBlocksPerSeq = 8, kSeqs = 24;
const std::vector<int64_t> kBuckets = {16, 32, 64, 128};

// Padding changes the GEMMs' row counts (so cuBLASLt's kernels and their
// summation order) and bf16 rounding compounds over the layers: the real rows
// of a padded step may differ from the unpadded step by at most this much
// (logits of magnitude ~10 on the tiny model).
constexpr float kPadMaxAbs = 0.5f, kPadMeanAbs = 0.02f;

std::unique_ptr<ModelExecutor> load(std::vector<int64_t> buckets, bool eager_pad) {
  ModelOptions o;
  o.device = Device::kCuda;
  o.token_graph_sizes = std::move(buckets);
  o.token_graph_eager_pad = eager_pad;
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  (*m)->set_max_blocks_per_seq(kBlocksPerSeq);
  (*m)->reserve_step_buffers(512, 64);
  return std::move(*m);
}

// Sequence s lives in blocks 1 + s * kBlocksPerSeq ... (block 0 is what pad
// rows would read). lens[s]: tokens of s cached so far.
struct Steps {
  std::vector<int64_t> lens = std::vector<int64_t>(kSeqs, 0);
  int64_t next_fresh = 3;

  void add(StepInputs& in, int64_t s, int64_t n, bool logits) const {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = lens[s] + i;
      in.token_ids.push_back(static_cast<int32_t>((s * 131 + pos * 17) % 4000 + 3));
      in.positions.push_back(static_cast<int32_t>(pos));
      in.slot_mapping.push_back((1 + s * kBlocksPerSeq + pos / kBlockSize) * kBlockSize + pos % kBlockSize);
    }
    in.query_start.push_back(static_cast<int32_t>(in.token_ids.size()));
    in.context_lens.push_back(static_cast<int32_t>(lens[s]));
    if (logits) in.logit_indices.push_back(in.query_start.back() - 1);
    for (int64_t b = 0; b < kBlocksPerSeq; ++b) in.block_tables.push_back(static_cast<int32_t>(1 + s * kBlocksPerSeq + b));
  }
  // Prefill of sequences 0..2 (10, 17 and 23 tokens).
  StepInputs first() const {
    StepInputs in;
    in.query_start = {0};
    in.max_blocks_per_seq = kBlocksPerSeq;
    const int64_t n[3] = {10, 17, 23};
    for (int64_t s = 0; s < 3; ++s) add(in, s, n[s], true);
    return in;
  }
  // Decode rows of sequences 0..2 plus a fresh sequence's first T - 3 tokens.
  StepInputs mixed(int64_t T) const {
    StepInputs in;
    in.query_start = {0};
    in.max_blocks_per_seq = kBlocksPerSeq;
    for (int64_t s = 0; s < 3; ++s) add(in, s, 1, true);
    add(in, next_fresh, T - 3, true);
    return in;
  }
  void advance(int64_t T) {
    for (int64_t s = 0; s < 3; ++s) ++lens[s];
    lens[next_fresh] = T - 3;
    ++next_fresh;
  }
};

class TokenGraphTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(cuda_available()) << "GPU tests need a CUDA device"; }
};

TEST_F(TokenGraphTest, ReplayEqualsEagerPadAndUnpaddedForStepsAroundEveryBucket) {
  auto graphs = load(kBuckets, false), eager_pad = load(kBuckets, true), unpadded = load({}, false);
  const int64_t blocks = 1 + kSeqs * kBlocksPerSeq;
  KvCache kv_g = graphs->make_kv_cache(blocks, kBlockSize), kv_p = eager_pad->make_kv_cache(blocks, kBlockSize),
          kv_u = unpadded->make_kv_cache(blocks, kBlockSize);
  ASSERT_TRUE(graphs->capture_decode_graphs(kv_g).ok());
  ASSERT_TRUE(eager_pad->capture_decode_graphs(kv_p).ok());
  Steps steps;
  std::vector<std::pair<std::string, StepInputs>> plan = {{"first", steps.first()}};
  std::vector<int64_t> sizes;
  for (int64_t b : kBuckets)
    for (int64_t T : {b - 1, b, b + 1}) sizes.push_back(T);
  int64_t expected_replays = 0;
  auto check = [&](const std::string& what, const StepInputs& in) {
    const int64_t before = graphs->token_graph_replays();
    auto g = graphs->forward(in, kv_g);
    auto p = eager_pad->forward(in, kv_p);
    auto u = unpadded->forward(in, kv_u);
    ASSERT_TRUE(g.ok() && p.ok() && u.ok()) << what;
    const bool fits = graphs->token_bucket_for(in.num_tokens()) > 0;
    expected_replays += fits;
    EXPECT_EQ(graphs->token_graph_replays(), before + (fits ? 1 : 0)) << what;
    Tensor hg = to_host(*g), hp = to_host(*p), hu = to_host(*u);
    ASSERT_EQ(hg.numel(), hp.numel());
    ASSERT_EQ(hg.numel(), hu.numel());
    EXPECT_EQ(std::memcmp(hg.raw(), hp.raw(), hg.nbytes()), 0) << what << ": replay differs from the eager padded step";
    double worst = 0, sum = 0;
    for (int64_t i = 0; i < hg.numel(); ++i) {
      const double d = std::fabs(hg.data<float>()[i] - hu.data<float>()[i]);
      worst = std::max(worst, d);
      sum += d;
    }
    std::printf("%-22s tokens %4lld bucket %4lld: padded vs unpadded max %.4f mean %.5f\n", what.c_str(),
                static_cast<long long>(in.num_tokens()),
                static_cast<long long>(graphs->token_bucket_for(in.num_tokens())), worst, sum / hg.numel());
    EXPECT_LE(worst, kPadMaxAbs) << what;
    EXPECT_LE(sum / hg.numel(), kPadMeanAbs) << what;
  };
  check("first", plan[0].second);
  for (int64_t T : sizes) {
    check("mixed T=" + std::to_string(T), steps.mixed(T));
    steps.advance(T);
  }
  EXPECT_EQ(graphs->token_graph_replays(), expected_replays);
  EXPECT_EQ(eager_pad->token_graph_replays(), 0);
}

TEST_F(TokenGraphTest, PadRowsWriteNoKv) {
  auto m = load(kBuckets, false);
  const int64_t blocks = 1 + kSeqs * kBlocksPerSeq;
  KvCache kv = m->make_kv_cache(blocks, kBlockSize);
  std::vector<uint8_t> sentinel(kv.data.nbytes(), 0x7b);  // bf16 0x7b7b
  copy_to_device(kv.data.raw(), sentinel.data(), sentinel.size());
  ASSERT_TRUE(m->capture_decode_graphs(kv).ok());
  Steps steps;
  StepInputs in = steps.mixed(31);  // 31 real rows padded to 32 (decode rows read the sentinel: fine)
  ASSERT_EQ(m->token_bucket_for(in.num_tokens()), 32);
  ASSERT_TRUE(m->forward(in, kv).ok());
  EXPECT_EQ(m->token_graph_replays(), 1);
  const std::set<int64_t> written(in.slot_mapping.begin(), in.slot_mapping.end());
  Tensor host = to_host(kv.data);
  const int64_t row_bytes = kv.width * 2;
  int64_t changed_outside = 0, unwritten = 0;
  for (int64_t l = 0; l < kv.num_layers; ++l)
    for (int64_t slot = 0; slot < kv.num_slots(); ++slot) {
      const uint8_t* row = static_cast<const uint8_t*>(host.raw()) + (l * kv.num_slots() + slot) * row_bytes;
      bool intact = true;
      for (int64_t i = 0; i < row_bytes; ++i) intact &= row[i] == 0x7b;
      if (written.count(slot))
        unwritten += intact;
      else
        changed_outside += !intact;
    }
  EXPECT_EQ(unwritten, 0);
  EXPECT_EQ(changed_outside, 0);
}

}  // namespace
}  // namespace nucleus
