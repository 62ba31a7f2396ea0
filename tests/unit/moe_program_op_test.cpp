// Which MoE blocks the moe_program op (ops/moe_program_op.h) can serve:
// moe_program_supported on blocks built as the decode graph builds them
// (bf16 weights described on the host, no data): the shipped tiny model's
// and DeepSeek-V2-Lite's and V3's routing are accepted; FP8 weights, an
// o_proj input wider than the kernel's x, greedy routing in groups, top-k
// above 8, a folded add + norm and experts of mixed widths are refused with
// the reason.
#include <gtest/gtest.h>

#include <deque>
#include <memory>

#include "core/tensor.h"
#include "ops/moe_program_op.h"

namespace nucleus {
namespace {

struct Block {
  int64_t hidden = 256, o_k = 4 * 64, inter = 192, experts = 8, shared = 1, top_k = 2;
  DType dtype = DType::kBF16;
  std::deque<LinearWeight> w;  // stable addresses
  Tensor norm = Tensor::empty({256}, DType::kF32);

  const LinearWeight* linear(const std::string& name, int64_t out, int64_t in) {
    LinearWeight lw;
    lw.name = name;
    lw.out_features = out;
    lw.in_features = in;
    lw.weight = Tensor::empty({out, in}, dtype);
    w.push_back(std::move(lw));
    return &w.back();
  }
  std::unique_ptr<MoeProgramOp> op(kernels::MoeRoutingParams r) {
    r.num_experts = experts;
    r.top_k = top_k;
    r.shared_slots = shared;
    std::vector<ExpertWeights> ex;
    for (int64_t e = 0; e < experts + shared; ++e)
      ex.push_back({linear("e" + std::to_string(e) + ".gate_up", 2 * inter, hidden),
                    linear("e" + std::to_string(e) + ".down", hidden, inter)});
    MoeProgramOp::Parts p;
    p.o_proj = std::make_unique<LinearOp>(linear("o_proj", hidden, o_k), false);
    p.norm = std::make_unique<AddRmsNormOp>(norm, 1e-6f, true);
    p.router = std::make_unique<LinearOp>(linear("gate", experts, hidden), false);
    p.route = std::make_unique<MoeRouteOp>(r, Tensor());
    p.experts = std::make_unique<MoeExpertsOp>(std::move(ex), inter, r.slots());
    return std::make_unique<MoeProgramOp>(1, std::move(p), hidden, shared);
  }
};

kernels::MoeRoutingParams noaux(int64_t groups, int64_t kept) {
  kernels::MoeRoutingParams r;
  r.scoring = ScoringFunc::kSigmoid;
  r.method = TopkMethod::kNoauxTc;
  r.n_group = groups;
  r.topk_group = kept;
  r.norm_topk_prob = true;
  return r;
}

::testing::AssertionResult refused(const MoeProgramOp& op, const std::string& why) {
  const Status s = moe_program_supported(op);
  if (s.ok()) return ::testing::AssertionFailure() << "accepted; expected a refusal naming '" << why << "'";
  if (s.message().find(why) == std::string::npos) return ::testing::AssertionFailure() << "refused with: " << s.message();
  return ::testing::AssertionSuccess();
}

TEST(MoeProgramOp, AcceptsTheShippedTinyModelV2LiteAndV3Routing) {
  Block tiny;  // models/tiny-dsv3: 8 experts, noaux_tc in 4 groups (2 kept), top-2, one shared expert
  EXPECT_TRUE(moe_program_supported(*tiny.op(noaux(4, 2))).ok());
  Block v2_lite;  // 64 experts of 1408, greedy softmax top-6, two shared pieces, o_proj 2048 x 2048
  v2_lite.hidden = v2_lite.o_k = 2048;
  v2_lite.norm = Tensor::empty({2048}, DType::kF32);
  v2_lite.inter = 1408;
  v2_lite.experts = 64;
  v2_lite.shared = 2;
  v2_lite.top_k = 6;
  const Status s = moe_program_supported(*v2_lite.op(kernels::MoeRoutingParams{}));
  EXPECT_TRUE(s.ok()) << s.message();
  Block v3;  // V3's routing at a smaller hidden: 256 experts, noaux_tc in 8 groups (4 kept), top-8
  v3.experts = 256;
  v3.top_k = 8;
  EXPECT_TRUE(moe_program_supported(*v3.op(noaux(8, 4))).ok());
}

TEST(MoeProgramOp, RefusesWhatTheProgramCannotRun) {
  {
    Block b;
    b.dtype = DType::kF8E4M3;
    EXPECT_TRUE(refused(*b.op(noaux(4, 2)), "is not bf16"));
  }
  {
    Block b;  // V3's o_proj: 128 heads x 128 = 16384 inputs, wider than x in shared memory
    b.o_k = 16384;
    EXPECT_TRUE(refused(*b.op(noaux(4, 2)), "an input width of 16384"));
  }
  {
    Block b;
    kernels::MoeRoutingParams r;
    r.method = TopkMethod::kGroupLimitedGreedy;  // DeepSeek-V2's routing
    r.n_group = 4;
    r.topk_group = 2;
    EXPECT_TRUE(refused(*b.op(r), "routing other than greedy or noaux_tc"));
  }
  {
    Block b;
    b.top_k = 9;
    b.experts = 16;
    EXPECT_TRUE(refused(*b.op(kernels::MoeRoutingParams{}), "top_k 9"));
  }
  {
    Block b;
    b.experts = 400;
    EXPECT_TRUE(refused(*b.op(kernels::MoeRoutingParams{}), "more than 384 routed experts"));
  }
  {
    Block b;
    b.inter = 200;  // not a multiple of 16
    EXPECT_TRUE(refused(*b.op(noaux(4, 2)), "an expert of width 200"));
  }
  {
    Block b;
    auto op = b.op(noaux(4, 2));
    op->parts().experts->fuse_add_rmsnorm(b.norm, 1e-6f);
    EXPECT_TRUE(refused(*op, "the experts op runs the next add + norm"));
  }
  {
    Block b;
    b.hidden = 8208;
    EXPECT_TRUE(refused(*b.op(noaux(4, 2)), "hidden size 8208"));
  }
}

}  // namespace
}  // namespace nucleus
