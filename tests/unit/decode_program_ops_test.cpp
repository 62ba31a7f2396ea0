// Which MoE blocks and attention fronts the decode-program ops
// (ops/moe_program_op.h, ops/front_program_op.h) can serve. MoE blocks:
// moe_program_supported on blocks built as the decode graph builds them
// (bf16 weights described on the host, no data): the shipped tiny model's
// and DeepSeek-V2-Lite's and V3's routing are accepted; FP8 weights, an
// o_proj input wider than the kernel's x, greedy routing in groups, top-k
// above 8, a folded add + norm and experts of mixed widths are refused with
// the reason. Fronts: with and without a q LoRA accepted; FP8 weights, an
// FP8 cache, an unfused kv norm, no device RoPE frequencies refused; the
// query absorption accepted with a bf16 kv_b_proj of at most 64 heads.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <deque>
#include <memory>

#include "core/tensor.h"
#include "ops/decode_program.h"
#include "ops/front_program_op.h"
#include "ops/moe_program_op.h"

namespace nucleus {
namespace {

struct Block {
  int64_t hidden = 256, o_k = 4 * 64, inter = 192, experts = 8, shared = 1, top_k = 2;
  DType dtype = DType::kBF16;
  bool fp8_scales = true;  // FP8 linears get 128 x 128 block scales
  std::deque<LinearWeight> w;  // stable addresses
  Tensor norm = Tensor::empty({256}, DType::kF32);

  const LinearWeight* linear(const std::string& name, int64_t out, int64_t in) {
    LinearWeight lw;
    lw.name = name;
    lw.out_features = out;
    lw.in_features = in;
    lw.weight = Tensor::empty({out, in}, dtype);
    if (dtype == DType::kF8E4M3 && fp8_scales) {  // DeepSeek-V3's 128 x 128 block scales
      lw.block_n = lw.block_k = 128;
      lw.scale_inv = Tensor::empty({(out + 127) / 128, (in + 127) / 128}, DType::kF32);
    }
    w.push_back(std::move(lw));
    return &w.back();
  }
  std::unique_ptr<MoeProgramOp> op(kernels::MoeRoutingParams r) {
    r.num_experts = experts;
    r.top_k = top_k;
    r.shared_slots = shared;
    std::vector<ExpertWeights> ex;
    for (int64_t e = 0; e < experts + shared; ++e) {
      const std::string name = fmt::format("e{}", e);  // (GCC 12 warns, wrongly, on "e" + std::to_string(e))
      ex.push_back({linear(name + ".gate_up", 2 * inter, hidden), linear(name + ".down", hidden, inter)});
    }
    MoeProgramOp::Parts p;
    p.o_proj = std::make_unique<LinearOp>(linear("o_proj", hidden, o_k), false);
    p.norm = std::make_unique<AddRmsNormOp>(norm, 1e-6f, true);
    const DType linears = dtype;
    dtype = DType::kBF16;  // the router stays bf16 (DeepSeek-V3's FP8 checkpoints do not quantize the gate)
    p.router = std::make_unique<LinearOp>(linear("gate", experts, hidden), false);
    dtype = linears;
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
    Block b;  // FP8 e4m3 with DeepSeek-V3's block scales: programs read it
    b.dtype = DType::kF8E4M3;
    const Status s = moe_program_supported(*b.op(noaux(4, 2)));
    EXPECT_TRUE(s.ok()) << s.message();
    b.fp8_scales = false;  // without them (or with other blocks): refused
    EXPECT_TRUE(refused(*b.op(noaux(4, 2)), "programs read FP8 weights with 128 x 128 block scales"));
  }
  {
    Block b;  // scales of another shape than [ceil(out / 128), ceil(in / 128)]
    b.dtype = DType::kF8E4M3;
    auto op = b.op(noaux(4, 2));
    const_cast<LinearWeight&>(op->parts().o_proj->weight()).scale_inv = Tensor::empty({3}, DType::kF32);
    EXPECT_TRUE(refused(*op, "o_proj: 3 block scales, not the [ceil(out / 128), ceil(in / 128)] = 4"));
  }
  {
    Block b;
    b.dtype = DType::kF32;
    EXPECT_TRUE(refused(*b.op(noaux(4, 2)), "is neither bf16 nor FP8 e4m3"));
  }
  {
    Block b;  // V3's o_proj at one rank: 128 heads x 128 = 16384 inputs, read from global memory
    b.o_k = 16384;
    const Status s = moe_program_supported(*b.op(noaux(4, 2)));
    EXPECT_TRUE(s.ok()) << s.message();
    b.o_k = 32784;
    EXPECT_TRUE(refused(*b.op(noaux(4, 2)), "an input width of 32784"));
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

struct Front {
  int64_t layer = 1, hidden = 256, heads = 4, q_lora = 128;
  bool absorb = false;  // give the front kv_b_proj (the absorption)
  DType dtype = DType::kBF16, kv_b_dtype = DType::kBF16;
  bool fp8_scales = true;  // FP8 linears get 128 x 128 block scales
  KvCacheDtype cache = KvCacheDtype::kBF16;
  bool fuse_kv_norm = true;
  const float* inv_freq = reinterpret_cast<const float*>(uintptr_t{1} << 32);  // a device address (never read here)
  std::deque<LinearWeight> w;
  Tensor norm = Tensor::empty({256}, DType::kF32), q_norm = Tensor::empty({128}, DType::kF32),
         kv_norm = Tensor::empty({512}, DType::kF32);
  kernels::RopeTable table;

  const LinearWeight* linear(const std::string& name, int64_t out, int64_t in) {
    LinearWeight lw;
    lw.name = name;
    lw.out_features = out;
    lw.in_features = in;
    lw.weight = Tensor::empty({out, in}, dtype);
    if (dtype == DType::kF8E4M3 && fp8_scales) {  // DeepSeek-V3's 128 x 128 block scales
      lw.block_n = lw.block_k = 128;
      lw.scale_inv = Tensor::empty({(out + 127) / 128, (in + 127) / 128}, DType::kF32);
    }
    w.push_back(std::move(lw));
    return &w.back();
  }
  std::unique_ptr<FrontProgramOp> op() {
    kernels::MlaDims d;
    d.num_heads = heads;
    d.qk_nope = 128;
    d.qk_rope = 64;
    d.v_head = 128;
    d.kv_lora = 512;
    FrontProgramOp::Parts p;
    p.norm = std::make_unique<AddRmsNormOp>(norm, 1e-6f, true);
    if (q_lora > 0) {
      p.q_a = std::make_unique<LinearOp>(linear("q_a_proj", q_lora, hidden), false);
      p.q_a_norm = std::make_unique<RmsNormOp>(q_norm, 1e-6f);
      p.q_b = std::make_unique<LinearOp>(linear("q_b_proj", heads * 192, q_lora), false);
    } else {
      p.q_proj = std::make_unique<LinearOp>(linear("q_proj", heads * 192, hidden), false);
    }
    p.kv_a = std::make_unique<LinearOp>(linear("kv_a_proj_with_mqa", 576, hidden), false);
    p.rope = std::make_unique<RopeKvCacheWriteOp>(layer, &table, d, inv_freq, 1.0f, cache);
    if (fuse_kv_norm) p.rope->fuse_kv_norm(kv_norm, 1e-6f);
    if (absorb) {
      const DType keep = dtype;
      dtype = kv_b_dtype;
      p.kv_b = linear("kv_b_proj", heads * 256, 512);
      dtype = keep;
    }
    return std::make_unique<FrontProgramOp>(layer, std::move(p), hidden);
  }
};

TEST(FrontProgramOp, AcceptsFrontsWithAndWithoutAQLora) {
  Front tiny;  // models/tiny-dsv3: hidden 256, 4 heads, q_lora 128
  Status s = front_program_supported(*tiny.op());
  EXPECT_TRUE(s.ok()) << s.message();
  Front v2_lite;  // no q LoRA, 16 heads
  v2_lite.hidden = 2048;
  v2_lite.norm = Tensor::empty({2048}, DType::kF32);
  v2_lite.heads = 16;
  v2_lite.q_lora = 0;
  s = front_program_supported(*v2_lite.op());
  EXPECT_TRUE(s.ok()) << s.message();
}

TEST(FrontProgramOp, RefusesWhatTheProgramCannotRun) {
  auto refused_front = [](Front& f, const std::string& why) {
    const Status s = front_program_supported(*f.op());
    if (s.ok()) return ::testing::AssertionFailure() << "accepted; expected '" << why << "'";
    if (s.message().find(why) == std::string::npos) return ::testing::AssertionFailure() << "refused with: " << s.message();
    return ::testing::AssertionSuccess();
  };
  {
    Front f;  // FP8 e4m3 with block scales: accepted; without: refused
    f.dtype = DType::kF8E4M3;
    const Status s = front_program_supported(*f.op());
    EXPECT_TRUE(s.ok()) << s.message();
    f.fp8_scales = false;
    EXPECT_TRUE(refused_front(f, "programs read FP8 weights with 128 x 128 block scales"));
  }
  {
    Front f;
    f.cache = KvCacheDtype::kFp8E4M3;
    EXPECT_TRUE(refused_front(f, "the KV cache is not bf16"));
  }
  {
    Front f;
    f.fuse_kv_norm = false;
    EXPECT_TRUE(refused_front(f, "NUCLEUS_FUSE_KV_A_NORM=0"));
  }
  {
    Front f;
    f.inv_freq = nullptr;
    EXPECT_TRUE(refused_front(f, "no device RoPE frequencies"));
  }
  {
    Front f;
    f.q_lora = 120;
    f.q_norm = Tensor::empty({120}, DType::kF32);
    EXPECT_TRUE(refused_front(f, "q_lora_rank 120"));
  }
  // The absorption (NUCLEUS_DECODE_PROGRAM_ABSORB): a bf16 kv_b_proj of at most 64 heads.
  {
    Front f;
    f.absorb = true;
    auto op = f.op();
    EXPECT_TRUE(op->absorbs());
    const Status s = front_program_supported(*op);
    EXPECT_TRUE(s.ok()) << s.message();
    EXPECT_NE(op->attrs().find("absorbs"), std::string::npos) << op->attrs();
  }
  {
    Front f;  // an FP8 kv_b_proj: W_UK^T is transposed with its block scales
    f.absorb = true;
    f.kv_b_dtype = DType::kF8E4M3;
    const Status s = front_program_supported(*f.op());
    EXPECT_TRUE(s.ok()) << s.message();
    f.fp8_scales = false;
    EXPECT_TRUE(refused_front(f, "kv_b_proj: programs read FP8 weights with 128 x 128 block scales"));
  }
  {
    Front f;  // V3 at one rank: 128 heads
    f.absorb = true;
    f.heads = 128;
    const Status s = front_program_supported(*f.op());
    EXPECT_TRUE(s.ok()) << s.message();
    f.heads = 160;
    EXPECT_TRUE(refused_front(f, "at most 128 heads"));
  }
  // The attention in the front (NUCLEUS_DECODE_PROGRAM_ATTENTION): an absorbing front with a buffer and a scale.
  {
    Front f;
    f.absorb = true;
    auto op = f.op();
    op->set_attend(true, 0.135f, std::make_shared<ProgramAttentionBuffer>());
    const Status s = front_program_supported(*op);
    EXPECT_TRUE(s.ok()) << s.message();
    EXPECT_NE(op->attrs().find("attends"), std::string::npos) << op->attrs();
    op->set_attend(true, 0.135f, nullptr);
    EXPECT_FALSE(front_program_supported(*op).ok());
    op->set_attend(false);  // taken back
    EXPECT_TRUE(front_program_supported(*op).ok());
    EXPECT_EQ(op->attend_buffer(), nullptr);
    Front plain;  // not absorbing: no q_full to attend with
    auto p = plain.op();
    p->set_attend(true, 0.135f, std::make_shared<ProgramAttentionBuffer>());
    const Status no = front_program_supported(*p);
    EXPECT_FALSE(no.ok());
    EXPECT_NE(no.message().find("absorbs the query"), std::string::npos) << no.message();
  }
}

// NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT: a MoE program runs the attention's
// split merge and W_UV only for this layer's attention op set to leave them
// (output_in_program_rows 8), of DeepSeek's latent widths, at most 64 heads,
// a bf16 kv_b_proj, and an o_proj reading its heads.
TEST(MoeProgramOp, TakesTheAttentionOutputOfItsOwnLayer) {
  Block b;  // layer 1, o_proj reading 2 heads x 128
  b.o_k = 2 * 128;
  auto op = b.op(noaux(4, 2));
  kernels::MlaDims d;
  d.num_heads = 2;
  d.qk_nope = 128;
  d.qk_rope = 64;
  d.v_head = 128;
  d.kv_lora = 512;
  const LinearWeight* kv_b = b.linear("kv_b_proj", 2 * 256, 512);
  MlaDecodeAttentionOp attn(1, kv_b, d, AttentionMode::kAuto);
  op->set_attention(&attn);
  EXPECT_TRUE(refused(*op, "set to leave its output to the program"));
  attn.set_output_in_program_rows(8);
  Status s = moe_program_supported(*op);
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_NE(op->attrs().find("+attention output"), std::string::npos) << op->attrs();
  op->set_max_rows(4);  // NUCLEUS_DECODE_PROGRAM_MAX_ROWS=4: the attention must stop for the same steps
  EXPECT_TRUE(refused(*op, "set to leave its output to the program"));
  attn.set_output_in_program_rows(4);
  s = moe_program_supported(*op);
  EXPECT_TRUE(s.ok()) << s.message();
  op->set_max_rows(8);
  attn.set_output_in_program_rows(8);
  // The attention run in the front program: the block needs the front's partials buffer.
  attn.set_output_in_program_rows(0);
  attn.set_attention_in_program_rows(8);
  EXPECT_TRUE(refused(*op, "no partials buffer"));
  op->set_attention_buffer(std::make_shared<ProgramAttentionBuffer>());
  s = moe_program_supported(*op);
  EXPECT_TRUE(s.ok()) << s.message();
  op->set_attention_buffer(nullptr);
  attn.set_attention_in_program_rows(0);
  attn.set_output_in_program_rows(8);
  MlaDecodeAttentionOp other_layer(2, kv_b, d, AttentionMode::kAuto);
  other_layer.set_output_in_program_rows(8);
  op->set_attention(&other_layer);
  EXPECT_TRUE(refused(*op, "is not this layer's"));
  kernels::MlaDims narrow = d;
  narrow.kv_lora = 256;
  MlaDecodeAttentionOp narrow_attn(1, kv_b, narrow, AttentionMode::kAuto);
  narrow_attn.set_output_in_program_rows(8);
  op->set_attention(&narrow_attn);
  EXPECT_TRUE(refused(*op, "needs kv_lora 512"));
  b.dtype = DType::kF8E4M3;
  const LinearWeight* fp8 = b.linear("kv_b_proj_fp8", 2 * 256, 512);
  MlaDecodeAttentionOp fp8_attn(1, fp8, d, AttentionMode::kAuto);
  fp8_attn.set_output_in_program_rows(8);
  op->set_attention(&fp8_attn);
  const Status fp8_ok = moe_program_supported(*op);  // an FP8 kv_b_proj with block scales: W_UV reads e4m3
  EXPECT_TRUE(fp8_ok.ok()) << fp8_ok.message();
  b.fp8_scales = false;
  const LinearWeight* unscaled = b.linear("kv_b_proj_unscaled", 2 * 256, 512);
  MlaDecodeAttentionOp unscaled_attn(1, unscaled, d, AttentionMode::kAuto);
  unscaled_attn.set_output_in_program_rows(8);
  op->set_attention(&unscaled_attn);
  EXPECT_TRUE(refused(*op, "kv_b_proj_unscaled: programs read FP8 weights with 128 x 128 block scales"));
  Block wide;  // o_proj reading 384 inputs: not the attention's 2 x 128 heads
  wide.o_k = 384;
  auto op2 = wide.op(noaux(4, 2));
  op2->set_attention(&attn);
  EXPECT_TRUE(refused(*op2, "o_proj does not read the attention's heads"));
}

// NUCLEUS_DECODE_PROGRAM_JOIN: a MoE program takes the next layer's front
// (one launch a layer boundary) only when that front is one a program serves,
// of the next layer, reading the block's delta at the same hidden size.
// A dense layer (MoeProgramOp::dense): o_proj, the add + norm and the MLP's
// gate_up, SiLU * up and down, bf16 or FP8, up to 32768 intermediate units
// (the down projection reads x from global memory); its parts are the MLP's,
// never router, routing or experts.
TEST(MoeProgramOp, DenseLayerMlp) {
  auto dense = [](Block& b, int64_t inter) {
    MoeProgramOp::Parts p;
    p.o_proj = std::make_unique<LinearOp>(b.linear("o_proj", b.hidden, b.o_k), false);
    p.norm = std::make_unique<AddRmsNormOp>(b.norm, 1e-6f, true);
    p.gate_up = std::make_unique<LinearOp>(b.linear("mlp.gate_up_proj", 2 * inter, b.hidden), false);
    p.act = std::make_unique<SiluMulOp>();
    p.down = std::make_unique<LinearOp>(b.linear("mlp.down_proj", b.hidden, inter), false);
    return std::make_unique<MoeProgramOp>(0, std::move(p), b.hidden, 0);
  };
  {
    Block b;  // V2-Lite's dense MLP width
    auto op = dense(b, 10944);
    EXPECT_TRUE(op->dense());
    const Status s = moe_program_supported(*op);
    EXPECT_TRUE(s.ok()) << s.message();
    EXPECT_NE(op->attrs().find("dense MLP 10944"), std::string::npos) << op->attrs();
  }
  {
    Block b;  // FP8 with block scales
    b.dtype = DType::kF8E4M3;
    const Status s = moe_program_supported(*dense(b, 768));
    EXPECT_TRUE(s.ok()) << s.message();
  }
  {
    Block b;  // wider than a program's x reads
    EXPECT_TRUE(refused(*dense(b, 32784), "an MLP of width 32784"));
  }
  {
    Block b;  // a dense op without its act, or with a router, is not a block the program knows
    auto op = dense(b, 768);
    op->parts().act.reset();
    EXPECT_TRUE(refused(*op, "a part of the block is missing"));
    auto mixed = dense(b, 768);
    mixed->parts().router = std::make_unique<LinearOp>(b.linear("gate", 8, b.hidden), false);
    EXPECT_TRUE(refused(*mixed, "a part of the block is missing"));
  }
}

TEST(MoeProgramOp, JoinsOnlyTheNextLayersFront) {
  Block b;  // layer 1
  auto op = b.op(noaux(4, 2));
  Front next;
  next.layer = 2;
  op->set_next_front(next.op());
  Status s = moe_program_supported(*op);
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_NE(op->attrs().find("+front of layer 2"), std::string::npos) << op->attrs();
  {
    Front same;  // layer 1: not the next layer's
    op->set_next_front(same.op());
    EXPECT_TRUE(refused(*op, "the joined front is not the next layer's (layer 1"));
  }
  {
    Front wide;
    wide.layer = 2;
    wide.hidden = 512;
    wide.norm = Tensor::empty({512}, DType::kF32);
    op->set_next_front(wide.op());
    EXPECT_TRUE(refused(*op, "hidden 512"));
  }
  {
    Front fewer;  // a front that runs programs for fewer rows than the block
    fewer.layer = 2;
    auto f = fewer.op();
    f->set_max_rows(2);
    op->set_next_front(std::move(f));
    EXPECT_TRUE(refused(*op, "at most 2 rows a program"));
  }
  {
    Front fp8;
    fp8.layer = 2;
    fp8.dtype = DType::kF8E4M3;
    fp8.fp8_scales = false;
    op->set_next_front(fp8.op());
    EXPECT_TRUE(refused(*op, "the joined front: q_a_proj: programs read FP8 weights with 128 x 128 block scales"));
    // The model takes a refused front back and adds it as its own op.
    std::unique_ptr<FrontProgramOp> back = op->take_next_front();
    ASSERT_NE(back, nullptr);
    EXPECT_EQ(back->layer(), 2);
    EXPECT_EQ(op->next_front(), nullptr);
    EXPECT_TRUE(moe_program_supported(*op).ok());
  }
}

// NUCLEUS_DECODE_PROGRAM_MAX_ROWS: 1, 2, 4 or 8 (default 8); anything else
// reads as 8 and is refused at start-up, naming the value.
TEST(DecodeProgram, MaxRowsSwitch) {
  unsetenv("NUCLEUS_DECODE_PROGRAM_MAX_ROWS");
  EXPECT_EQ(decode_program_max_rows(), 8);
  EXPECT_TRUE(decode_program_env_status().ok());
  for (const char* v : {"1", "2", "4", "8"}) {
    setenv("NUCLEUS_DECODE_PROGRAM_MAX_ROWS", v, 1);
    EXPECT_EQ(decode_program_max_rows(), std::stoi(v));
    EXPECT_TRUE(decode_program_env_status().ok());
  }
  for (const char* v : {"3", "16", "0", "eight"}) {
    setenv("NUCLEUS_DECODE_PROGRAM_MAX_ROWS", v, 1);
    EXPECT_EQ(decode_program_max_rows(), 8);
    const Status s = decode_program_env_status();
    EXPECT_FALSE(s.ok());
    std::string want = "NUCLEUS_DECODE_PROGRAM_MAX_ROWS='";
    want += v;
    want += "' is not 1, 2, 4 or 8";
    EXPECT_EQ(s.message(), want);
  }
  unsetenv("NUCLEUS_DECODE_PROGRAM_MAX_ROWS");
  EXPECT_EQ(decode_program_widths_text(4),
            "widths 1, 2, 4 run as programs; steps of more than 4 rows run the separate ops "
            "(NUCLEUS_DECODE_PROGRAM_MAX_ROWS)");
}

}  // namespace
}  // namespace nucleus
