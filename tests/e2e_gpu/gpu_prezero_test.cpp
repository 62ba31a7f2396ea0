// Prezero on the CUDA backend with tiny-dsv3 (every GEMM of its decode graph
// runs split-K under NUCLEUS_SPLITK=auto):
//  - the decode graph after the passes: 8 donors (2 of them the MoE ops that
//    run the next layer's input add + norm, NUCLEUS_MOE_COMBINE_NORM), 16 consumers (19 with
//    the shared MLP as its own ops, NUCLEUS_MOE_FUSE_SHARED=0) on
//    cuda_splitk writing f32 slices, their readers converting back to bf16
//    (kv_a_proj is no consumer: its reader, the RoPE + latent-cache write
//    with kv_a_layernorm fused in (NUCLEUS_FUSE_KV_A_NORM), reads bf16);
//    without the flag, split-K f32 outputs but nothing of prezero;
//  - the gate's three outcomes (all, base, none) each taken at a batch size
//    <= 64 (so the consumers run split-K) by lowering the idle bytes credited
//    per SM; at those sizes, in the deterministic reduction, logits and the
//    KV cache with prezero ON are bit-identical to OFF, in graph replay and
//    eagerly; with f32 atomics they agree within reordering tolerance;
//  - greedy outputs through the engine ON equal OFF (and the reference up to
//    its first near-tie), and are identical token for token in the
//    deterministic reduction;
//  - with tensor parallelism's all-reduce in the same norms (a one-rank NCCL
//    group): every donor all-reduces (o_proj's f32 split-K slice) and fills,
//    fused and unfused, and matches the plain model.
#include <gtest/gtest.h>

#include <cstdlib>

#include <array>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "gpu_test_util.h"
#include "runtime/model_executor.h"
#include "ops/basic_ops.h"
#include "ops/moe_ops.h"
#include "ops/linear_op.h"
#include "ops/prezero.h"
#include "ops/splitk.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

// Split-K is off by default until measured; these tests exercise its "auto"
// rule unless NUCLEUS_SPLITK is set otherwise.
static const bool kSplitKAutoForTests = [] { return setenv("NUCLEUS_SPLITK", "auto", /*overwrite=*/0) == 0; }();

namespace nucleus {
namespace {

using nlohmann::json;

// tiny-dsv3's attention donor: q_a 128 + q_b 768 = 896 base, + o_proj 256.
// (kv_a_proj's 576 left the donor with the fused kv_a_layernorm.)
constexpr int64_t kNTotal = 1152, kNBase = 896;
// Idle bytes per SM that put all three outcomes below 65 rows on a 132-SM
// H200 (m * n * 4 <= (132 - m) * 2048: all for m <= 40, base 41..48, none
// from 49).
constexpr int64_t kIdleBytes = 2048;
constexpr int64_t kBlockSize = 16, kContext = 5;

std::unique_ptr<ModelExecutor> load(bool prezero, std::vector<int64_t> graph_sizes) {
  ModelOptions o;
  o.device = Device::kCuda;
  o.enable_prezero = prezero;
  o.cuda_graph_sizes = std::move(graph_sizes);
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// The same model as a one-rank tensor-parallel group (NCCL on the single
// H200): its norms all-reduce, through the fused kernel or NCCL + add+norm.
std::unique_ptr<ModelExecutor> load_group(bool fuse, std::vector<int64_t> graph_sizes) {
  ModelOptions o;
  o.device = Device::kCuda;
  o.enable_prezero = true;
  o.cuda_graph_sizes = std::move(graph_sizes);
  o.force_tp_group = true;
  o.fuse_allreduce_norm = fuse;
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

class GpuPrezeroTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available()) << "GPU tests need a CUDA device";
    ASSERT_NE(splitk_switch(), SplitKSwitch::kOff) << "run without NUCLEUS_SPLITK=0";
    set_prezero_idle_bytes_per_sm(kIdleBytes);
  }
  void TearDown() override {
    set_prezero_idle_bytes_per_sm(0);
    reset_splitk_deterministic();
  }
};

// The smallest batch size <= 64 taking each outcome: {all, base, none}.
std::array<int64_t, 3> sizes_for_outcomes() {
  std::array<int64_t, 3> s = {0, 0, 0};
  for (int64_t m = 64; m >= 1; --m) {
    const PrezeroFill f = prezero_fill(m, kNTotal, kNBase);
    s[f == PrezeroFill::kAll ? 0 : f == PrezeroFill::kBase ? 1 : 2] = m;
  }
  return s;
}

StepInputs decode_step(int64_t n, int64_t blocks) {
  return testing::decode_step_after_context(n, blocks, kContext, kBlockSize);
}

TEST_F(GpuPrezeroTest, DecodeGraphRewritten) {
  auto on = load(true, {});
  auto off = load(false, {});
  int donors = 0, moe_donors = 0, consumers = 0;
  const StepGraph& g = on->graph(StepKind::kDecode);
  for (const Node& n : g.nodes()) {
    if (auto* norm = dynamic_cast<const AddRmsNormOp*>(n.op.get()); norm && norm->prezero().n_total > 0) {
      ++donors;
      EXPECT_EQ(n.op->backend(), "cuda");
      if (n.name.find("input_layernorm") != std::string::npos) {
        EXPECT_EQ(norm->prezero().n_total, kNTotal);
        EXPECT_EQ(norm->prezero().n_base, kNBase);
      }
    }
    // A MoE op running the next layer's input add + norm (NUCLEUS_MOE_COMBINE_NORM) is its donor.
    if (auto* moe = dynamic_cast<const MoeExpertsOp*>(n.op.get()); moe && moe->prezero().n_total > 0) {
      ++donors;
      ++moe_donors;
      EXPECT_TRUE(moe->fuses_add_rmsnorm()) << n.name;
      EXPECT_EQ(moe->prezero().n_total, kNTotal) << n.name;
      EXPECT_EQ(moe->prezero().n_base, kNBase) << n.name;
    }
    if (auto* lin = dynamic_cast<const LinearOp*>(n.op.get()); lin && lin->prezero_gate_n() > 0) {
      ++consumers;
      EXPECT_EQ(lin->backend(), "cuda_splitk") << n.name;
      const BufferDesc& out = g.buffers()[n.outputs[0]];
      EXPECT_GE(out.parent, 0) << n.name;
      EXPECT_EQ(out.dtype, DType::kF32) << n.name;
    }
    if (n.name == "layers.2.self_attn.q_a_layernorm") {  // reads the f32 slice, writes bf16 q_a
      EXPECT_EQ(g.buffers()[n.inputs[0]].name, "prezero.2.attn.q_a_proj");
      EXPECT_EQ(g.buffers()[n.outputs[0]].name, "q_a");
      EXPECT_EQ(g.buffers()[n.outputs[0]].dtype, DType::kBF16);
    }
  }
  EXPECT_EQ(donors, 8);
  // With the shared experts inside the MoE op, the MoE ops of layers 1 and 2
  // run the input norms of layers 2 and 3 (and layer 3's the final norm, no
  // donor) unless NUCLEUS_MOE_COMBINE_NORM=0.
  auto set_to_0 = [](const char* name) { const char* v = std::getenv(name); return v && std::string(v) == "0"; };
  if (!set_to_0("NUCLEUS_MOE_FUSE_SHARED") && !set_to_0("NUCLEUS_MOE_COMBINE_NORM")) EXPECT_EQ(moe_donors, 2);
  // The three MoE layers count two consumers each with the shared MLP as
  // its own ops (NUCLEUS_MOE_FUSE_SHARED=0: 19 in all), one each with the
  // shared experts inside the routed experts' op (auto on CUDA, or 1: 16),
  // both counts as the H200 runs measured them (session 13).
  bool shared_mlp_ops = false;
  for (const Node& n : g.nodes()) shared_mlp_ops |= n.name.find("mlp.shared_experts") != std::string::npos;
  EXPECT_EQ(consumers, 4 * 3 + 1 + 3 * (shared_mlp_ops ? 2 : 1)) << (shared_mlp_ops ? "shared MLP ops" : "fused");
  if (!std::getenv("NUCLEUS_MOE_FUSE_SHARED")) EXPECT_FALSE(shared_mlp_ops) << "auto fuses the shared experts on CUDA";
  const std::string off_dump = off->graph(StepKind::kDecode).dump("off");
  EXPECT_EQ(off_dump.find("prezero"), std::string::npos);
  EXPECT_NE(off_dump.find("q_a.f32"), std::string::npos) << "split-K outputs are f32 with prezero off too";
  EXPECT_EQ(on->graph(StepKind::kPrefill).dump("prefill").find("prezero"), std::string::npos);
}

// Logits and caches of ON and OFF at the three outcome sizes, largest first
// and each twice (a consumer adding onto a slice its donor did not zero would
// read the previous step's values), graph replay then eager.
void compare_on_off(bool deterministic) {
  set_splitk_deterministic(deterministic);
  const auto sizes = sizes_for_outcomes();
  for (int64_t s : sizes) ASSERT_GT(s, 0) << "an outcome of the gate is not reachable at m <= 64";
  std::vector<int64_t> graph_sizes(sizes.begin(), sizes.end());
  std::sort(graph_sizes.begin(), graph_sizes.end());
  const int64_t blocks = (kContext + 1 + kBlockSize - 1) / kBlockSize, max_seqs = graph_sizes.back();
  std::map<bool, std::unique_ptr<ModelExecutor>> models;
  std::map<bool, KvCache> caches;
  for (bool prezero : {true, false}) {
    models[prezero] = load(prezero, graph_sizes);
    models[prezero]->set_max_blocks_per_seq(blocks);
    models[prezero]->reserve_step_buffers(max_seqs, max_seqs);
    caches[prezero] = models[prezero]->make_kv_cache(1 + max_seqs * blocks, kBlockSize);
    ASSERT_TRUE(models[prezero]->capture_decode_graphs(caches[prezero]).ok());
  }
  double worst = 0;
  for (bool eager : {false, true}) {
    for (int64_t n : {sizes[2], sizes[2], sizes[1], sizes[1], sizes[0], sizes[0]}) {
      SCOPED_TRACE(std::string(eager ? "eager" : "graph") + " batch " + std::to_string(n) + " fill " +
                   prezero_fill_name(prezero_fill(n, kNTotal, kNBase)));
      StepInputs d = decode_step(n, blocks);
      std::map<bool, Tensor> logits;
      for (bool prezero : {true, false}) {
        testing::fill_cache_pattern(caches[prezero]);
        StepStats stats;  // forces the eager path
        auto l = models[prezero]->forward(d, caches[prezero], eager ? &stats : nullptr);
        ASSERT_TRUE(l.ok()) << l.status().to_string();
        logits[prezero] = *l;
      }
      ASSERT_EQ(logits[true].nbytes(), logits[false].nbytes());
      if (deterministic) {
        EXPECT_EQ(std::memcmp(logits[true].raw(), logits[false].raw(), logits[true].nbytes()), 0);
        Tensor a = to_host(caches[true].data), b = to_host(caches[false].data);
        EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0);
      } else {
        const float* a = logits[true].data<float>();
        const float* b = logits[false].data<float>();
        std::vector<float> va(a, a + logits[true].numel()), vb(b, b + logits[false].numel());
        // f32 sums reordered by the atomics can flip bf16 roundings of the activations downstream.
        auto r = testing::all_close(va, vb, 0.05f, 0.02f, logits[true].dim(1));
        EXPECT_TRUE(r);
        for (size_t i = 0; i < va.size(); ++i) worst = std::max<double>(worst, std::fabs(va[i] - vb[i]));
      }
    }
  }
  if (!deterministic) std::printf("prezero on vs off (f32 atomics): max |logit difference| %.3g\n", worst);
}

TEST_F(GpuPrezeroTest, OnEqualsOffBitForBitDeterministicForEachGateOutcome) { compare_on_off(true); }

TEST_F(GpuPrezeroTest, OnWithinReorderingToleranceOfOffWithAtomics) { compare_on_off(false); }

// Donors that all-reduce: on a one-rank group every norm after o_proj and
// after the MLP/MoE is both the all-reduce and the prezero donor; its delta
// after the attention is o_proj's f32 split-K slice. In the deterministic
// reduction the unfused group (NCCL over one rank is a copy) equals the
// plain prezero model bit for bit; the fused kernel's norm sums in another
// order (within the reordering tolerance). Each gate outcome, graph replay
// then eager.
TEST_F(GpuPrezeroTest, OneRankGroupDonorsAllReduceAndFill) {
  set_splitk_deterministic(true);
  const auto sizes = sizes_for_outcomes();
  for (int64_t s : sizes) ASSERT_GT(s, 0) << "an outcome of the gate is not reachable at m <= 64";
  std::vector<int64_t> graph_sizes(sizes.begin(), sizes.end());
  std::sort(graph_sizes.begin(), graph_sizes.end());
  const int64_t blocks = (kContext + 1 + kBlockSize - 1) / kBlockSize, max_seqs = graph_sizes.back();
  std::map<std::string, std::unique_ptr<ModelExecutor>> models;
  std::map<std::string, KvCache> caches;
  models["plain"] = load(true, graph_sizes);
  models["unfused"] = load_group(false, graph_sizes);
  models["fused"] = load_group(true, graph_sizes);
  for (auto& [name, m] : models) {
    m->set_max_blocks_per_seq(blocks);
    m->reserve_step_buffers(max_seqs, max_seqs);
    caches[name] = m->make_kv_cache(1 + max_seqs * blocks, kBlockSize);
    ASSERT_TRUE(m->capture_decode_graphs(caches[name]).ok()) << name;
  }
  for (const char* name : {"unfused", "fused"}) {
    SCOPED_TRACE(name);
    const StepGraph& g = models[name]->rank(0).graph(StepKind::kDecode);
    int donors = 0, all_reducing = 0;
    for (const Node& n : g.nodes()) {
      auto* norm = dynamic_cast<const AddRmsNormOp*>(n.op.get());
      if (!norm || norm->prezero().n_total == 0) continue;
      ++donors;
      if (!norm->all_reduce().comm) continue;
      ++all_reducing;
      EXPECT_EQ(n.op->backend(), std::string(name) == "fused" ? "cuda_allreduce_fused" : "cuda") << n.name;
      if (n.name == "layers.1.post_attention_layernorm") {
        EXPECT_EQ(g.buffers()[n.inputs[1]].name, "prezero.1.attn.o_proj");
        EXPECT_EQ(g.buffers()[n.inputs[1]].dtype, DType::kF32);
      }
    }
    EXPECT_EQ(donors, 8);
    EXPECT_EQ(all_reducing, 7);  // all but layer 0's input norm (no delta)
  }
  for (bool eager : {false, true}) {
    for (int64_t n : {sizes[2], sizes[1], sizes[0], sizes[0]}) {
      SCOPED_TRACE(std::string(eager ? "eager" : "graph") + " batch " + std::to_string(n) + " fill " +
                   prezero_fill_name(prezero_fill(n, kNTotal, kNBase)));
      StepInputs d = decode_step(n, blocks);
      std::map<std::string, Tensor> logits;
      for (auto& [name, m] : models) {
        testing::fill_cache_pattern(caches[name]);
        StepStats stats;  // forces the eager path
        auto l = m->forward(d, caches[name], eager ? &stats : nullptr);
        ASSERT_TRUE(l.ok()) << name << ": " << l.status().to_string();
        logits[name] = *l;
      }
      ASSERT_EQ(logits["unfused"].nbytes(), logits["plain"].nbytes());
      EXPECT_EQ(std::memcmp(logits["unfused"].raw(), logits["plain"].raw(), logits["plain"].nbytes()), 0);
      const float* a = logits["fused"].data<float>();
      const float* b = logits["plain"].data<float>();
      std::vector<float> va(a, a + logits["fused"].numel()), vb(b, b + logits["plain"].numel());
      EXPECT_TRUE(testing::all_close(va, vb, 0.05f, 0.02f, logits["plain"].dim(1)));
    }
  }
}

struct Case {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> margins;
};

std::map<std::string, std::vector<int32_t>> run_greedy(bool prezero, const std::vector<Case>& cases) {
  EngineConfig ec;
  ec.block_size = 16;
  ec.num_kv_blocks = 256;
  ec.max_num_seqs = 8;
  auto e = LLMEngine::create(load(prezero, {1, 2, 4, 8}), ec);
  NUCLEUS_CHECK(e.ok(), "{}", e.status().to_string());
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 32;
  sp.ignore_eos = true;
  for (size_t i = 0; i < cases.size(); ++i) NUCLEUS_CHECK_OK((*e)->add_request("r" + std::to_string(i), cases[i].prompt, sp));
  std::map<std::string, std::vector<int32_t>> out;
  while ((*e)->has_unfinished())
    for (const auto& o : (*e)->step())
      out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  return out;
}

TEST_F(GpuPrezeroTest, GreedyOutputsOnEqualOff) {
  std::ifstream in(testing::model_path("ref/cases.json"));
  const json all = json::parse(in);
  std::vector<Case> cases;
  for (const auto& c : all["tiny-dsv3"])
    cases.push_back({c["prompt_token_ids"].get<std::vector<int32_t>>(), c["greedy_token_ids"].get<std::vector<int32_t>>(),
                     c["greedy_top2_margins"].get<std::vector<float>>()});
  set_prezero_idle_bytes_per_sm(0);  // the default gate: batches of up to 8 fill everything
  for (bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic" : "atomics");
    set_splitk_deterministic(deterministic);
    auto on = run_greedy(true, cases), off = run_greedy(false, cases);
    if (deterministic) {
      EXPECT_EQ(on, off);
    }
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto& a = on.at("r" + std::to_string(i));
      const auto& b = off.at("r" + std::to_string(i));
      ASSERT_EQ(a.size(), cases[i].greedy.size());
      ASSERT_EQ(b.size(), cases[i].greedy.size());
      // Up to the reference's first near-tie, ON, OFF and the reference agree.
      for (size_t s = 0; s < a.size() && cases[i].margins[s] >= 0.05f; ++s) {
        EXPECT_EQ(a[s], cases[i].greedy[s]) << "case " << i << " step " << s;
        EXPECT_EQ(a[s], b[s]) << "case " << i << " step " << s;
      }
    }
  }
}

}  // namespace
}  // namespace nucleus
