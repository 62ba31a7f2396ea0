// The prezero pass on the CPU reference (tiny-dsv3): the gate's three
// outcomes, the rewritten decode graph (donors, buffer widths, slices per
// consumer), nothing rewritten in prefill or with the flag off, and outputs
// with the pass equal to outputs without it, bit for bit, at step sizes
// that take each outcome.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "graph/passes/prezero_pass.h"
#include "runtime/model_executor.h"
#include "ops/basic_ops.h"
#include "ops/linear_op.h"
#include "ops/moe_ops.h"
#include "ops/prezero.h"
#include "test_util.h"

namespace nucleus {
namespace {

std::unique_ptr<ModelExecutor> load(bool prezero) {
  ModelOptions o;
  o.enable_prezero = prezero;
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// tiny-dsv3's attention donor: q_a 128 + kv_a 576 + q_b 4 * 192 = 1472 base,
// + o_proj 256 = 1728. On the notional 132-SM device with 64 KiB per idle SM:
// all for m <= 119, the base for m = 120, 121, nothing from 122.
TEST(PrezeroTest, GateOutcomes) {
  ASSERT_EQ(prezero_sm_count(), 132);
  EXPECT_EQ(prezero_fill(1, 1728, 1472), PrezeroFill::kAll);
  EXPECT_EQ(prezero_fill(119, 1728, 1472), PrezeroFill::kAll);
  EXPECT_EQ(prezero_fill(120, 1728, 1472), PrezeroFill::kBase);
  EXPECT_EQ(prezero_fill(121, 1728, 1472), PrezeroFill::kBase);
  EXPECT_EQ(prezero_fill(122, 1728, 1472), PrezeroFill::kNone);
  EXPECT_EQ(prezero_fill(200, 1728, 1472), PrezeroFill::kNone);
  EXPECT_FALSE(is_prezero_free(0, 10));
}

TEST(PrezeroTest, DecodeGraphRewritten) {
  auto m = load(true);
  const StepGraph& g = m->graph(StepKind::kDecode);
  int donors = 0, consumers = 0;
  for (const Node& n : g.nodes()) {
    if (auto* norm = dynamic_cast<const AddRmsNormOp*>(n.op.get()); norm && norm->prezero().n_total > 0) {
      ++donors;
      ASSERT_EQ(n.outputs.size(), 3u);
      const BufferDesc& b = g.buffers()[n.outputs[2]];
      EXPECT_EQ(b.width, norm->prezero().n_total) << n.name;
      EXPECT_EQ(b.dtype, DType::kF32);
      if (n.name.find("input_layernorm") != std::string::npos) {
        EXPECT_EQ(norm->prezero().n_total, 1728) << n.name;
        EXPECT_EQ(norm->prezero().n_base, 1472) << n.name;
      } else if (n.name == "layers.0.post_attention_layernorm") {
        EXPECT_EQ(norm->prezero().n_total, 2 * 768);  // dense gate_up
      } else {
        EXPECT_EQ(norm->prezero().n_total, 8 + 2 * 192);  // router | shared experts' gate_up
        EXPECT_EQ(norm->prezero().n_base, 8 + 2 * 192);
      }
      ASSERT_FALSE(n.notes.empty());
      EXPECT_NE(n.notes[0].find("prezero donor"), std::string::npos);
    }
    if (auto* lin = dynamic_cast<const LinearOp*>(n.op.get()); lin && lin->prezero_gate_n() > 0) {
      ++consumers;
      const BufferDesc& out = g.buffers()[n.outputs[0]];
      EXPECT_GE(out.parent, 0) << n.name << " writes a slice";
      EXPECT_EQ(out.width, lin->weight().out_features);
      if (n.name.find("o_proj") != std::string::npos) {
        EXPECT_EQ(out.col_offset, 1472);
        EXPECT_EQ(lin->prezero_gate_n(), 1728);  // the tail: zeroed only when everything is
      }
      if (n.name.find("q_a_proj") != std::string::npos) {
        EXPECT_EQ(out.col_offset, 0);
      }
      if (n.name.find("kv_a_proj") != std::string::npos) {
        EXPECT_EQ(out.col_offset, 128);
      }
      if (n.name.find("q_b_proj") != std::string::npos) {
        EXPECT_EQ(out.col_offset, 128 + 576);
        EXPECT_EQ(lin->prezero_gate_n(), 1472);
      }
    }
  }
  EXPECT_EQ(donors, 8);              // 4 layers x (input, post-attention)
  EXPECT_EQ(consumers, 4 * 4 + 1 + 3 * 2);  // attention 4 per layer; dense gate_up; router + shared gate_up
  // The slices' readers were rewired: q_a_layernorm works on the q_a slice.
  for (const Node& n : g.nodes()) {
    if (n.name == "layers.1.self_attn.q_a_layernorm") {
      EXPECT_EQ(g.buffers()[n.inputs[0]].name, "prezero.1.attn.q_a_proj");
    }
  }
  EXPECT_NE(g.dump("decode").find("prezero donor"), std::string::npos);
}

// What NUCLEUS_DUMP_GRAPH=1 prints after the passes, line by line.
TEST(PrezeroTest, DumpNamesDonorsBuffersAndSlices) {
  auto m = load(true);
  const std::string dump = m->graph(StepKind::kDecode).dump("decode (after passes)");
  auto line_of = [&](const std::string& node) {
    const size_t at = dump.find(" " + node + " ");
    if (at == std::string::npos) return std::string();
    const size_t begin = dump.rfind('\n', at) + 1;
    return dump.substr(begin, dump.find('\n', at) - begin);
  };
  const std::string donor = line_of("layers.1.input_layernorm");
  EXPECT_NE(donor.find("prezero.1.attn[T,1728,F32]"), std::string::npos) << donor;
  EXPECT_NE(donor.find("prezero_n_total=1728 prezero_n_base=1472"), std::string::npos) << donor;
  EXPECT_NE(donor.find("<prezero donor: fills prezero.1.attn [T, 1728] (all, or the first 1472 columns"),
            std::string::npos)
      << donor;
  const std::string q_b = line_of("layers.1.self_attn.q_b_proj");
  EXPECT_NE(q_b.find("-> prezero.1.attn.q_b_proj[T,768,F32]=slice(prezero.1.attn,704)"), std::string::npos) << q_b;
  EXPECT_NE(q_b.find("zero_init=gate(m,1472)"), std::string::npos) << q_b;
  EXPECT_NE(q_b.find("<prezero consumer: columns [704, 1472) of prezero.1.attn"), std::string::npos) << q_b;
  const std::string o = line_of("layers.1.self_attn.o_proj");
  EXPECT_NE(o.find("slice(prezero.1.attn,1472)"), std::string::npos) << o;
  EXPECT_NE(o.find("zero_init=gate(m,1728)"), std::string::npos) << o;
  const std::string post = line_of("layers.1.post_attention_layernorm");
  EXPECT_NE(post.find("prezero.1.attn.o_proj[T,256,F32]=slice"), std::string::npos) << "reads o_proj's slice: " << post;
  EXPECT_NE(post.find("prezero.1.ffn[T,392,F32]"), std::string::npos) << post;
  EXPECT_NE(line_of("layers.1.mlp.route").find("prezero.1.ffn.gate[T,8,F32]=slice(prezero.1.ffn,0)"),
            std::string::npos);
  EXPECT_NE(line_of("layers.1.mlp.shared_experts.act").find("prezero.1.ffn.gate_up_proj[T,384,F32]=slice(prezero.1.ffn,8)"),
            std::string::npos);
  EXPECT_EQ(line_of("layers.1.mlp.shared_experts.down_proj").find("prezero"), std::string::npos);
  // The prefill graph of the same model: nothing of the pass.
  EXPECT_EQ(m->graph(StepKind::kPrefill).dump("prefill").find("prezero"), std::string::npos);
}

TEST(PrezeroTest, NothingRewrittenInPrefillOrWithFlagOff) {
  auto on = load(true);
  auto off = load(false);
  for (const StepGraph* g : {&on->graph(StepKind::kPrefill), &off->graph(StepKind::kPrefill),
                             &off->graph(StepKind::kDecode)}) {
    const std::string dump = g->dump("g");
    EXPECT_EQ(dump.find("prezero"), std::string::npos);
    for (const BufferDesc& b : g->buffers()) EXPECT_LT(b.parent, 0);
  }
}

// A decode step of n sequences with `context` cached tokens each (the cache
// holds whatever a prefill of distinct tokens wrote).
StepInputs decode_step(int64_t n, int64_t context, int64_t block_size) {
  StepInputs d;
  d.query_start = {0};
  const int64_t blocks = (context + 1 + block_size - 1) / block_size;
  d.max_blocks_per_seq = static_cast<int32_t>(blocks);
  for (int64_t s = 0; s < n; ++s) {
    d.token_ids.push_back(static_cast<int32_t>(3 + (s * 7) % 4000));
    d.positions.push_back(static_cast<int32_t>(context));
    d.slot_mapping.push_back((s * blocks + context / block_size) * block_size + context % block_size);
    d.query_start.push_back(static_cast<int32_t>(s + 1));
    d.context_lens.push_back(static_cast<int32_t>(context));
    d.logit_indices.push_back(static_cast<int32_t>(s));
    for (int64_t b = 0; b < blocks; ++b) d.block_tables.push_back(static_cast<int32_t>(s * blocks + b));
  }
  return d;
}

TEST(PrezeroTest, OnEqualsOffBitForBitForEachGateOutcome) {
  auto on = load(true);
  auto off = load(false);
  const int64_t bs = 16, context = 5;
  // Largest first, twice: later steps reuse step buffers that hold the
  // previous step's values, so a consumer that accumulated into a slice the
  // donor did not zero would show.
  for (int64_t n : {130, 130, 121, 120, 7, 1}) {  // none, none, base, base, all, all
    KvCache kv_on = on->make_kv_cache(n, bs), kv_off = off->make_kv_cache(n, bs);
    // Fill the caches identically (random-ish rows), then decode one step.
    for (KvCache* kv : {&kv_on, &kv_off})
      for (int64_t i = 0; i < kv->data.numel(); ++i) kv->data.data<float>()[i] = 0.01f * static_cast<float>((i * 37) % 101 - 50);
    StepInputs d = decode_step(n, context, bs);
    auto a = on->forward(d, kv_on);
    auto b = off->forward(d, kv_off);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->nbytes(), b->nbytes());
    EXPECT_EQ(std::memcmp(a->raw(), b->raw(), a->nbytes()), 0) << "batch " << n;
    EXPECT_EQ(std::memcmp(kv_on.data.raw(), kv_off.data.raw(), kv_on.data.nbytes()), 0) << "batch " << n;
  }
}

// With the shared experts inside the MoE op (NUCLEUS_MOE_FUSE_SHARED=1) the
// decode graph folds the next add + norm into the MoE ops of layers 1-3
// (NUCLEUS_MOE_COMBINE_NORM, auto): those of layers 1 and 2 run the input
// norms of layers 2 and 3, so they are those layers' attention donors (their
// fill buffer a fifth output), and prezero on equals off bit for bit.
TEST(PrezeroTest, MoeOpsRunningTheNextNormAreDonors) {
  setenv("NUCLEUS_MOE_FUSE_SHARED", "1", 1);
  auto on = load(true);
  auto off = load(false);
  unsetenv("NUCLEUS_MOE_FUSE_SHARED");
  const StepGraph& g = on->graph(StepKind::kDecode);
  int norm_donors = 0;
  std::vector<std::string> moe_donors;
  for (const Node& n : g.nodes()) {
    if (auto* norm = dynamic_cast<const AddRmsNormOp*>(n.op.get()); norm && norm->prezero().n_total > 0) ++norm_donors;
    if (auto* moe = dynamic_cast<const MoeExpertsOp*>(n.op.get()); moe && moe->prezero().n_total > 0) {
      moe_donors.push_back(n.name);
      EXPECT_TRUE(moe->fuses_add_rmsnorm());
      EXPECT_EQ(moe->prezero().n_total, 1728);
      EXPECT_EQ(moe->prezero().n_base, 1472);
      ASSERT_EQ(n.outputs.size(), 5u);
      EXPECT_EQ(g.buffers()[n.outputs[4]].width, 1728);
    }
  }
  EXPECT_EQ(norm_donors, 6);  // layers 0 and 1's input norms, the four post-attention norms
  EXPECT_EQ(moe_donors, (std::vector<std::string>{"layers.1.mlp.experts", "layers.2.mlp.experts"}));
  const int64_t bs = 16, context = 5;
  for (int64_t n : {130, 121, 7, 1}) {  // none, base, all, all
    KvCache kv_on = on->make_kv_cache(n, bs), kv_off = off->make_kv_cache(n, bs);
    StepInputs d = decode_step(n, context, bs);
    auto a = on->forward(d, kv_on);
    auto b = off->forward(d, kv_off);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(std::memcmp(a->raw(), b->raw(), a->nbytes()), 0) << "batch " << n;
  }
}

// The same with fewer idle bytes credited per SM (NUCLEUS_PREZERO_IDLE_BYTES_PER_SM),
// which moves the outcomes below 65 rows, where the GPU's consumers run split-K.
TEST(PrezeroTest, OnEqualsOffWithTheIdleBytesKnob) {
  set_prezero_idle_bytes_per_sm(4096);
  auto on = load(true);
  auto off = load(false);
  const int64_t bs = 16, context = 3;
  for (int64_t n : {60, 60, 52, 52, 8, 8}) {  // none, base, all
    KvCache kv_on = on->make_kv_cache(n, bs), kv_off = off->make_kv_cache(n, bs);
    StepInputs d = decode_step(n, context, bs);
    auto a = on->forward(d, kv_on);
    auto b = off->forward(d, kv_off);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(std::memcmp(a->raw(), b->raw(), a->nbytes()), 0)
        << "batch " << n << " fill " << prezero_fill_name(prezero_fill(n, 1728, 1472));
  }
  set_prezero_idle_bytes_per_sm(0);
}

}  // namespace
}  // namespace nucleus
