// The graph passes' rewiring, without a GPU:
//  - readers_of_output / redirect_output on a hand-made graph (plain readers,
//    an in-place reader that becomes out of place, the next writer);
//  - the split-K choice (NUCLEUS_SPLITK=auto) and the gate's idle-bytes knob;
//  - in CUDA builds, the split-K and prezero passes on one DeepSeek layer
//    whose backends are chosen for CUDA (chosen, never run): which GEMMs get
//    f32 outputs, which readers convert back to bf16, which GEMMs are kept
//    off split-K and why, the donors' buffers and slices, and the dump.
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/op_cuda_error.h"
#include "graph/passes/prezero_pass.h"
#include "graph/passes/redirect.h"
#include "graph/passes/splitk_pass.h"
#include "ops/basic_ops.h"
#include "ops/linear_op.h"
#include "ops/prezero.h"
#include "ops/rope_kv_cache_write.h"
#include "ops/splitk.h"

// Split-K is off by default until measured; these tests exercise its "auto"
// rule unless NUCLEUS_SPLITK is set otherwise.
static const bool kSplitKAutoForTests = [] { return setenv("NUCLEUS_SPLITK", "auto", /*overwrite=*/0) == 0; }();

namespace nucleus {
namespace {

// An op that only has a name: for rewiring tests.
class NamedOp : public Op {
 public:
  explicit NamedOp(bool f32_ok = false) : f32_ok_(f32_ok) {}
  const char* kind() const override { return "named"; }
  Status select_backend(Device) override {
    backend_ = "none";
    return ok_status();
  }
  void run(OpContext&, const TensorList&, const TensorList&) override {}
  bool accepts_f32_input(size_t) const override { return f32_ok_; }

 private:
  bool f32_ok_;
};

TEST(RedirectTest, ReadersUpToTheNextWriterInPlaceReaderBecomesOutOfPlace) {
  StepGraph g;
  const int a = g.buffer("a", 4, DType::kBF16), b = g.buffer("b", 4, DType::kBF16), c = g.buffer("c", 4, DType::kF32);
  g.add("producer", std::make_unique<NamedOp>(), {b}, {a});  // 0
  g.add("reader", std::make_unique<NamedOp>(), {b, a}, {b});  // 1: reads a at input 1
  g.add("in_place", std::make_unique<NamedOp>(), {a}, {a});   // 2: the last use of this value
  g.add("after", std::make_unique<NamedOp>(), {a}, {b});      // 3: reads the converted a
  g.add("writer", std::make_unique<NamedOp>(), {b}, {a});     // 4: a new value
  g.add("late", std::make_unique<NamedOp>(), {a}, {b});       // 5
  auto readers = readers_of_output(g, 0, a);
  ASSERT_EQ(readers.size(), 2u);
  EXPECT_EQ(readers[0], (std::pair<size_t, size_t>{1, 1}));
  EXPECT_EQ(readers[1], (std::pair<size_t, size_t>{2, 0}));
  redirect_output(g, 0, a, c);
  EXPECT_EQ(g.nodes()[0].outputs, std::vector<int>{c});
  EXPECT_EQ(g.nodes()[1].inputs, (std::vector<int>{b, c}));
  EXPECT_EQ(g.nodes()[2].inputs, std::vector<int>{c});
  EXPECT_EQ(g.nodes()[2].outputs, std::vector<int>{a}) << "the in-place reader keeps writing the declared buffer";
  EXPECT_EQ(g.nodes()[3].inputs, std::vector<int>{a});
  EXPECT_EQ(g.nodes()[5].inputs, std::vector<int>{a});
  // The writer's own value: readers up to the end.
  EXPECT_EQ(readers_of_output(g, 4, a).size(), 1u);
}

TEST(SplitKChoiceTest, AutoFollowsTheMeasuredShapeTable) {
  if (splitk_switch() != SplitKSwitch::kAuto) GTEST_SKIP() << "NUCLEUS_SPLITK is set";
  EXPECT_EQ(splitk_max_rows(64, 2048), 64);      // V2-Lite MoE gate
  EXPECT_EQ(splitk_max_rows(256, 7168), 64);     // V3 MoE gate
  EXPECT_EQ(splitk_max_rows(576, 2048), 32);     // V2-Lite kv_a, 2.3 MB
  EXPECT_EQ(splitk_max_rows(576, 7168), 16);     // V3 kv_a, 8.3 MB
  EXPECT_EQ(splitk_max_rows(2048, 2048), 16);    // V2-Lite o_proj, 8 MiB
  EXPECT_EQ(splitk_max_rows(1536, 7168), 8);     // V3 q_a, 22 MB
  EXPECT_EQ(splitk_max_rows(3072, 2048), 0);     // V2-Lite q_proj
  EXPECT_EQ(splitk_max_rows(5632, 2048), 0);     // V2-Lite shared experts' gate_up
  EXPECT_EQ(splitk_max_rows(7168, 16384), 0);    // V3 o_proj
  EXPECT_EQ(splitk_max_rows(102400, 2048), 0);   // V2-Lite lm_head
  EXPECT_TRUE(splitk_env_status().ok());
}

TEST(PrezeroGateTest, IdleBytesKnobMovesTheOutcomes) {
  ASSERT_EQ(prezero_sm_count(), 132);
  set_prezero_idle_bytes_per_sm(4096);
  EXPECT_EQ(prezero_idle_bytes_per_sm(), 4096);
  // tiny-dsv3's attention donor (1728 | base 1472): m * 1728 * 4 <= (132 - m) * 4096 up to 49.
  EXPECT_EQ(prezero_fill(49, 1728, 1472), PrezeroFill::kAll);
  EXPECT_EQ(prezero_fill(50, 1728, 1472), PrezeroFill::kBase);
  EXPECT_EQ(prezero_fill(54, 1728, 1472), PrezeroFill::kBase);
  EXPECT_EQ(prezero_fill(55, 1728, 1472), PrezeroFill::kNone);
  set_prezero_idle_bytes_per_sm(0);
  EXPECT_EQ(prezero_idle_bytes_per_sm(), kPrezeroIdleBytesPerSm);
  EXPECT_EQ(prezero_fill(55, 1728, 1472), PrezeroFill::kAll);
}

#ifdef NUCLEUS_HAVE_CUDA
LinearWeight bf16_weight(int64_t n, int64_t k) {
  LinearWeight w;
  w.out_features = n;
  w.in_features = k;
  w.weight = Tensor::empty({n, k}, DType::kBF16);  // host memory: backends are chosen, never run
  return w;
}

// One layer of tiny-dsv3's decode graph as the CUDA backend declares it
// (activations bf16), plus a GEMM whose reader cannot read f32.
struct Layer {
  LinearWeight q_a = bf16_weight(128, 256), q_b = bf16_weight(768, 128), kv_a = bf16_weight(576, 256),
               o = bf16_weight(256, 512), gate = bf16_weight(8, 256), gate_up = bf16_weight(384, 256),
               down = bf16_weight(256, 192), extra = bf16_weight(64, 256);
  Tensor norm_w = Tensor::zeros({256}, DType::kF32), lora_w = Tensor::zeros({128}, DType::kF32),
         kv_w = Tensor::zeros({512}, DType::kF32);
  StepGraph g;

  Layer() {
    const DType bf = DType::kBF16;
    const int residual = g.buffer("residual", 256, DType::kF32), delta = g.buffer("delta", 256, bf),
              x_norm = g.buffer("x_norm", 256, bf), q_a_buf = g.buffer("q_a", 128, bf), q = g.buffer("q", 768, bf),
              kv = g.buffer("kv_a", 576, bf), attn = g.buffer("attn_out", 512, bf),
              logits = g.buffer("router_logits", 8, DType::kF32), gu = g.buffer("gate_up.192", 384, bf),
              act = g.buffer("mlp_act.192", 192, bf), extra_out = g.buffer("extra", 64, bf),
              probe = g.buffer("probe", 64, bf);
    kernels::MlaDims dims{4, 128, 64, 128, 512, 0.1f};
    auto lin = [](const LinearWeight& w, bool acc = false) { return std::make_unique<LinearOp>(&w, acc); };
    g.add("layers.0.input_layernorm", std::make_unique<AddRmsNormOp>(norm_w, 1e-6f, true), {residual, delta},
          {residual, x_norm});
    g.add("layers.0.self_attn.q_a_proj", lin(q_a), {x_norm}, {q_a_buf});
    g.add("layers.0.self_attn.q_a_layernorm", std::make_unique<RmsNormOp>(lora_w, 1e-6f), {q_a_buf}, {q_a_buf});
    g.add("layers.0.self_attn.q_b_proj", lin(q_b), {q_a_buf}, {q});
    g.add("layers.0.self_attn.kv_a_proj_with_mqa", lin(kv_a), {x_norm}, {kv});
    g.add("layers.0.self_attn.kv_a_layernorm", std::make_unique<RmsNormOp>(kv_w, 1e-6f), {kv}, {kv});
    g.add("layers.0.self_attn.rope_kv_cache_write", std::make_unique<RopeKvCacheWriteOp>(0, nullptr, dims), {q, kv},
          {q});
    g.add("layers.0.self_attn.attn_decode", std::make_unique<NamedOp>(), {q}, {attn});
    g.add("layers.0.self_attn.o_proj", lin(o), {attn}, {delta});
    g.add("layers.0.post_attention_layernorm", std::make_unique<AddRmsNormOp>(norm_w, 1e-6f, true),
          {residual, delta}, {residual, x_norm});
    g.add("layers.0.mlp.gate", lin(gate), {x_norm}, {logits});
    g.add("layers.0.mlp.shared_experts.gate_up_proj", lin(gate_up), {x_norm}, {gu});
    g.add("layers.0.mlp.shared_experts.act", std::make_unique<SiluMulOp>(), {gu}, {act});
    g.add("layers.0.mlp.shared_experts.down_proj", lin(down, true), {act}, {delta});
    g.add("extra_proj", lin(extra), {x_norm}, {extra_out});
    g.add("probe", std::make_unique<NamedOp>(), {extra_out}, {probe});
    for (Node& n : g.nodes())
      if (auto* l = dynamic_cast<LinearOp*>(n.op.get())) l->set_splitk_allowed(true);
    NUCLEUS_CHECK_OK(g.select_backends(Device::kCuda));
  }
  const Node& node(const std::string& name) const {
    size_t i = 0;
    while (i < g.nodes().size() && g.nodes()[i].name != name) ++i;
    NUCLEUS_CHECK(i < g.nodes().size(), "no node {}", name);
    return g.nodes()[i];
  }
  std::string in(const std::string& name, size_t i = 0) const { return g.buffers()[node(name).inputs[i]].name; }
  std::string out(const std::string& name, size_t i = 0) const { return g.buffers()[node(name).outputs[i]].name; }
};

TEST(CudaGraphPassesTest, SplitKGivesF32OutputsAndReadersConvert) {
  if (splitk_switch() != SplitKSwitch::kAuto) GTEST_SKIP() << "NUCLEUS_SPLITK is set";
  Layer l;
  EXPECT_EQ(l.node("layers.0.self_attn.q_a_proj").op->backend(), "cuda_splitk");
  auto r = apply_splitk_pass(l.g, Device::kCuda);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->redirected, 5);  // q_a, q_b, kv_a, o_proj, shared gate_up (the router writes f32 already)
  EXPECT_EQ(r->reselected, 2);  // down_proj adds onto bf16 delta; probe reads extra as bf16
  EXPECT_EQ(l.out("layers.0.self_attn.q_a_proj"), "q_a.f32");
  EXPECT_EQ(l.in("layers.0.self_attn.q_a_layernorm"), "q_a.f32");
  EXPECT_EQ(l.out("layers.0.self_attn.q_a_layernorm"), "q_a");
  EXPECT_EQ(l.in("layers.0.self_attn.q_b_proj"), "q_a");
  EXPECT_EQ(l.in("layers.0.self_attn.kv_a_layernorm"), "kv_a.f32");
  EXPECT_EQ(l.out("layers.0.self_attn.kv_a_layernorm"), "kv_a");
  EXPECT_EQ(l.in("layers.0.self_attn.rope_kv_cache_write", 0), "q.f32");
  EXPECT_EQ(l.in("layers.0.self_attn.rope_kv_cache_write", 1), "kv_a");
  EXPECT_EQ(l.out("layers.0.self_attn.rope_kv_cache_write"), "q");
  EXPECT_EQ(l.in("layers.0.self_attn.attn_decode"), "q");
  EXPECT_EQ(l.in("layers.0.post_attention_layernorm", 1), "delta.f32");
  EXPECT_EQ(l.in("layers.0.mlp.shared_experts.act"), "gate_up.192.f32");
  EXPECT_EQ(l.out("layers.0.mlp.shared_experts.down_proj"), "delta");
  EXPECT_EQ(l.node("layers.0.mlp.shared_experts.down_proj").op->backend(), "cublaslt");
  EXPECT_EQ(l.node("extra_proj").op->backend(), "cublaslt");
  EXPECT_EQ(l.out("extra_proj"), "extra");
  EXPECT_EQ(l.g.buffers()[l.g.find_buffer("q_a.f32")].dtype, DType::kF32);
  const std::string dump = l.g.dump("decode");
  EXPECT_NE(dump.find("splitk: f32 output q_a.f32"), std::string::npos);
  EXPECT_NE(dump.find("splitk: reads q_a.f32 (f32), writes q_a"), std::string::npos);
  EXPECT_NE(dump.find("splitk: not split-K (adds onto the BF16 buffer delta), cublaslt instead"), std::string::npos);
  EXPECT_NE(dump.find("q_a[T,128,BF16]"), std::string::npos);
  EXPECT_EQ(dump.find("prezero"), std::string::npos);
}

TEST(CudaGraphPassesTest, PrezeroSlicesTheSplitKOutputs) {
  if (splitk_switch() != SplitKSwitch::kAuto) GTEST_SKIP() << "NUCLEUS_SPLITK is set";
  Layer l;
  // Without the split-K pass a CUDA consumer still writes bf16: refused.
  EXPECT_FALSE(apply_prezero_pass(l.g).ok());
  Layer k;
  ASSERT_TRUE(apply_splitk_pass(k.g, Device::kCuda).ok());
  auto r = apply_prezero_pass(k.g);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->donors, 2);
  EXPECT_EQ(r->consumers, 4 + 2);
  const auto* in_norm = dynamic_cast<const AddRmsNormOp*>(k.node("layers.0.input_layernorm").op.get());
  EXPECT_EQ(in_norm->prezero().n_total, 128 + 576 + 768 + 256);
  EXPECT_EQ(in_norm->prezero().n_base, 128 + 576 + 768);
  EXPECT_EQ(k.out("layers.0.input_layernorm", 2), "prezero.0.attn");
  const auto* post = dynamic_cast<const AddRmsNormOp*>(k.node("layers.0.post_attention_layernorm").op.get());
  EXPECT_EQ(post->prezero().n_total, 8 + 384);
  EXPECT_EQ(k.out("layers.0.self_attn.q_a_proj"), "prezero.0.attn.q_a_proj");
  EXPECT_EQ(k.in("layers.0.self_attn.q_a_layernorm"), "prezero.0.attn.q_a_proj");
  EXPECT_EQ(k.out("layers.0.self_attn.q_a_layernorm"), "q_a");
  EXPECT_EQ(k.in("layers.0.self_attn.rope_kv_cache_write"), "prezero.0.attn.q_b_proj");
  EXPECT_EQ(k.in("layers.0.post_attention_layernorm", 1), "prezero.0.attn.o_proj");
  EXPECT_EQ(k.out("layers.0.mlp.gate"), "prezero.0.ffn.gate");
  EXPECT_EQ(k.in("layers.0.mlp.shared_experts.act"), "prezero.0.ffn.gate_up_proj");
  const BufferDesc& o = k.g.buffers()[k.node("layers.0.self_attn.o_proj").outputs[0]];
  EXPECT_EQ(o.col_offset, 1472);
  EXPECT_EQ(o.dtype, DType::kF32);
  const auto* o_op = dynamic_cast<const LinearOp*>(k.node("layers.0.self_attn.o_proj").op.get());
  EXPECT_EQ(o_op->prezero_gate_n(), 1728);
  EXPECT_EQ(o_op->prezero_max_rows(), 64) << "split-K serves m <= 64: no fill for larger steps";
  EXPECT_EQ(in_norm->prezero().max_rows, 64);
  EXPECT_FALSE(o_op->accumulate_for(65));
  EXPECT_EQ(prezero_fill(65, 1728, 1472, in_norm->prezero().max_rows), PrezeroFill::kNone);
  EXPECT_TRUE(o_op->accumulate_for(8));
  EXPECT_EQ(dynamic_cast<const LinearOp*>(k.node("extra_proj").op.get())->prezero_gate_n(), 0);
  const std::string dump = k.g.dump("decode");
  EXPECT_NE(dump.find("prezero donor: fills prezero.0.attn [T, 1728] (all, or the first 1472 columns"),
            std::string::npos);
  EXPECT_NE(dump.find("prezero.0.attn.o_proj[T,256,F32]=slice(prezero.0.attn,1472)"), std::string::npos);
}
#endif  // NUCLEUS_HAVE_CUDA

}  // namespace
}  // namespace nucleus

namespace nucleus {
namespace {

// An op whose CUDA call failed (NUCLEUS_OP_CUDA_CHECK throws OpCudaError):
// the step graph's runner reports it as the step's error naming the node,
// and runs nothing after it.
class FailingCudaOp : public Op {
 public:
  explicit FailingCudaOp(int* runs) : runs_(runs) {}
  const char* kind() const override { return "failing"; }
  Status select_backend(Device) override {
    backend_ = "cuda_test";
    return ok_status();
  }
  void run(OpContext&, const TensorList&, const TensorList&) override {
    ++*runs_;
    throw OpCudaError("op.cpp:1: cudaErrorIllegalAddress: an illegal memory access was encountered");
  }

 private:
  int* runs_;
};

class CountingOp : public NamedOp {
 public:
  explicit CountingOp(int* runs) : runs_(runs) {}
  void run(OpContext&, const TensorList&, const TensorList&) override { ++*runs_; }

 private:
  int* runs_;
};

TEST(RunNodesTest, AFailedCudaCallInAnOpIsTheStepsError) {
  int failing_runs = 0, later_runs = 0;
  StepGraph g;
  const int a = g.buffer("a", 4, DType::kF32);
  g.add("boom", std::make_unique<FailingCudaOp>(&failing_runs), {a}, {a});
  g.add("after", std::make_unique<CountingOp>(&later_runs), {a}, {a});
  for (auto& n : g.nodes()) ASSERT_TRUE(n.op->select_backend(Device::kCpu).ok());
  OpContext ctx;
  std::vector<Tensor> buffers = {Tensor::empty({1, 4}, DType::kF32, Device::kCpu)};
  Status s = run_nodes(g, ctx, buffers, 0, g.nodes().size());
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("cudaErrorIllegalAddress"), std::string::npos) << s.to_string();
  EXPECT_NE(s.to_string().find("node boom (failing, backend cuda_test)"), std::string::npos) << s.to_string();
  EXPECT_EQ(failing_runs, 1);
  EXPECT_EQ(later_runs, 0);
  EXPECT_FALSE(ctx.failed()) << "the runner hands the error over and clears it";
}

}  // namespace
}  // namespace nucleus
