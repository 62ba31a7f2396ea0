// CUDA backend of the moe_program op (ops/moe_program_cuda.h).
#include "ops/moe_program_cuda.h"

#include <cuda_runtime_api.h>


#include "core/cuda/context.h"
#include "core/device.h"
#include "kernels/common/device_sms.h"
#include "kernels/mono/mono_program_ref.h"
#include "ops/decode_program.h"
#include "ops/decode_program_cuda.h"
#include "ops/front_program_cuda.h"
#include "ops/mla_decode_cuda.h"

namespace nucleus::cuda_ops {

namespace {

namespace mono = kernels::mono;

constexpr int32_t kTile = 16;  // columns a GEMV job owns (docs/decode_program.md)

struct State {
  DecodeProgramRunner runner;
  Tensor logits, table, h, y, h_shared, y_shared, residual_out;
  Tensor o_lat;  // [8, heads, 512] bf16: the merged attention output (with set_attention)
  Tensor gate_up_table, down_table, shared_gate_up_table, shared_down_table;  // [experts] device pointers
  // FP8 experts: their block scales' addresses the same way (undefined for bf16).
  Tensor gate_up_scales, down_scales, shared_gate_up_scales, shared_down_scales;
};

// A device array of the given weights' addresses (scales: their block
// scales'; undefined when the weights are bf16).
Tensor pointer_table(const std::vector<const LinearWeight*>& w, bool scales = false) {
  if (scales && (w.empty() || !w[0]->fp8())) return Tensor();
  std::vector<uint64_t> ptrs(w.size());
  for (size_t i = 0; i < w.size(); ++i)
    ptrs[i] = reinterpret_cast<uint64_t>(scales ? w[i]->scale_inv.raw() : w[i]->weight.raw());
  Tensor t = Tensor::empty({static_cast<int64_t>(std::max<size_t>(1, ptrs.size()))}, DType::kI64, Device::kCuda);
  if (!ptrs.empty()) copy_to_device(t.raw(), ptrs.data(), ptrs.size() * sizeof(uint64_t));
  return t;
}
const void* const* weights(const Tensor& t) { return static_cast<const void* const*>(t.raw()); }
const float* const* scales(const Tensor& t) { return t.defined() ? static_cast<const float* const*>(t.raw()) : nullptr; }

// The block as a MoeChain over the op's weights and the state's buffers, for
// a program of `width` rows on the graph's attn_out, residual and delta.
mono::MoeChain chain(const MoeProgramOp& op, const State& s, int32_t width, const uint16_t* attn_out, float* residual,
                     uint16_t* delta) {
  const MoeProgramOp::Parts& p = op.parts();
  if (op.dense()) {  // the MLP as the one shared piece of a chain without routed experts
    mono::MoeChain c;
    c.hidden = op.hidden();
    c.shared_pieces = 1;
    c.shared_inter = p.down->weight().in_features;
    c.eps = p.norm->eps();
    c.w_o = p.o_proj->weight().weight.raw();
    c.o_scale = program_weight_scale(p.o_proj->weight());
    c.o_k = p.o_proj->weight().in_features;
    c.attn_out = attn_out;
    c.w_shared_gate_up = p.gate_up->weight().weight.raw();
    c.w_shared_down = p.down->weight().weight.raw();
    c.shared_gate_up_scale = program_weight_scale(p.gate_up->weight());
    c.shared_down_scale = program_weight_scale(p.down->weight());
    c.post_norm = p.norm->weight().data<float>();
    c.residual = residual;
    c.delta = delta;
    c.residual_out = s.residual_out.data<float>();
    c.h_shared = static_cast<uint16_t*>(s.h_shared.raw());
    c.y_shared = s.y_shared.data<float>();
    c.delta_out = delta;
    c.residual_copy_to = residual;
    (void)width;
    return c;
  }
  const kernels::MoeRoutingParams& r = p.route->params();
  const auto& ex = p.experts->experts();
  const int64_t E = r.num_experts;
  mono::MoeChain c;
  c.hidden = op.hidden();
  c.inter = ex[0].down->in_features;
  c.shared_pieces = static_cast<int32_t>(std::max<int64_t>(1, op.shared_pieces()));
  c.shared_inter = op.shared_pieces() > 0 ? ex[E].down->in_features : 0;
  c.slots = static_cast<int32_t>(std::min<int64_t>(width * r.top_k, E));
  c.num_experts = static_cast<int32_t>(E);
  c.top_k = static_cast<int32_t>(r.top_k);
  c.n_group = static_cast<int32_t>(r.method == TopkMethod::kNoauxTc ? r.n_group : 1);
  c.topk_group = static_cast<int32_t>(r.method == TopkMethod::kNoauxTc ? r.topk_group : 1);
  c.scoring = r.scoring == ScoringFunc::kSigmoid ? mono::Scoring::kSigmoid : mono::Scoring::kSoftmax;
  c.method = r.method == TopkMethod::kNoauxTc ? mono::TopK::kNoauxTc : mono::TopK::kGreedy;
  c.norm_topk_prob = r.norm_topk_prob;
  c.routed_scaling_factor = r.routed_scaling_factor;
  c.eps = p.norm->eps();
  c.w_o = p.o_proj->weight().weight.raw();
  c.o_scale = program_weight_scale(p.o_proj->weight());
  c.o_k = p.o_proj->weight().in_features;
  c.attn_out = attn_out;
  c.w_router = static_cast<const uint16_t*>(p.router->weight().weight.raw());
  c.gate_up_table = weights(s.gate_up_table);
  c.down_table = weights(s.down_table);
  c.gate_up_scale_table = scales(s.gate_up_scales);
  c.down_scale_table = scales(s.down_scales);
  if (op.shared_pieces() == 1) {  // one piece: a plain stage
    c.w_shared_gate_up = ex[E].gate_up->weight.raw();
    c.w_shared_down = ex[E].down->weight.raw();
    c.shared_gate_up_scale = program_weight_scale(*ex[E].gate_up);
    c.shared_down_scale = program_weight_scale(*ex[E].down);
  } else if (op.shared_pieces() > 1) {
    c.shared_gate_up_table = weights(s.shared_gate_up_table);
    c.shared_down_table = weights(s.shared_down_table);
    c.shared_gate_up_scale_table = scales(s.shared_gate_up_scales);
    c.shared_down_scale_table = scales(s.shared_down_scales);
  }
  c.bias = p.route->bias().defined() ? p.route->bias().data<float>() : nullptr;
  c.post_norm = p.norm->weight().data<float>();
  c.residual = residual;
  c.delta = delta;
  c.residual_out = s.residual_out.data<float>();
  c.logits = s.logits.data<float>();
  c.table = static_cast<mono::RouteTable*>(s.table.raw());
  c.h_shared = static_cast<uint16_t*>(s.h_shared.raw());
  c.y_shared = s.y_shared.data<float>();
  c.h = static_cast<uint16_t*>(s.h.raw());
  c.y = s.y.data<float>();
  c.delta_out = delta;
  c.residual_copy_to = residual;
  return c;
}

// The held ops, as the decode graph would run them.
void run_parts(MoeProgramOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  MoeProgramOp::Parts& p = op.parts();
  p.o_proj->run(ctx, {in[0]}, {out[1]});
  if (!ctx.error.ok()) return;
  p.norm->run(ctx, {in[1], out[1]}, {out[0], out[2]});
  if (!ctx.error.ok()) return;
  if (op.dense()) {  // out = {residual, delta, x_norm, gate_up, h}
    p.gate_up->run(ctx, {out[2]}, {out[3]});
    if (!ctx.error.ok()) return;
    p.act->run(ctx, {out[3]}, {out[4]});
    if (!ctx.error.ok()) return;
    p.down->run(ctx, {out[4]}, {out[1]});
    return;
  }
  p.router->run(ctx, {out[2]}, {out[3]});
  if (!ctx.error.ok()) return;
  p.route->run(ctx, {out[3]}, {out[4], out[5]});
  if (!ctx.error.ok()) return;
  p.experts->run(ctx, {out[2], out[4], out[5]}, {out[1], out[6]});
}

// The joined front's buffers within the op's (ops/moe_program_op.h).
TensorList front_in(const TensorList& out) { return {out[0], out[1]}; }
// (The block's own buffers: 7, a dense layer's 5.)
TensorList front_out(const MoeProgramOp& op, const TensorList& out) {
  TensorList o = {out[0], out[2]};
  for (size_t i = op.dense() ? 5 : 7; i < out.size(); ++i) o.push_back(out[i]);  // q, kv_a[, q_a][, q_full]
  return o;
}

// What the attention left for the program (with set_attention): its split
// plan and buffers for a step of `rows` rows, the step's row inputs.
struct AttentionLeft {
  MlaDecodeSplitPlan plan;
  const uint16_t* o_lat_in = nullptr;  // the attention's o_lat (one split)
  const int32_t *token_seq = nullptr, *query_start = nullptr, *context_lens = nullptr;
  float* program_partials = nullptr;  // a front program's kAttend partials (attention in programs)
};

// Whether the attention ran in the front program (its kAttend stage), not as the attention op.
bool attention_in_program(const MoeProgramOp& op) {
  return op.attention() && op.attention()->attention_in_program_rows() > 0;
}

// The attention output stages (merge, W_UV) on what the attention left, for
// a program of `width` rows.
std::vector<mono::Stage> attention_stages(const MoeProgramOp& op, const State& s, AttentionLeft a,
                                          uint16_t* attn_out, int32_t width) {
  const MlaDecodeAttentionOp& at = *op.attention();
  if (attention_in_program(op)) {  // the front program's split plan (ops/front_program_cuda.cpp)
    const mono::ProgramAttentionPlan plan =
        mono::program_attention_plan(width, static_cast<int32_t>(at.dims().num_heads),
                                     static_cast<int32_t>(at.dims().kv_lora), kernels::current_device_sms(),
                                     a.program_partials);
    a.plan.num_splits = plan.splits;
    a.plan.min_split_keys = mono::kProgramAttentionMinSplitKeys;
    a.plan.key_tile = mono::kProgramAttentionKeyTile;
    a.plan.part_o = plan.part_o;
    a.plan.part_lse = plan.part_lse;
    a.o_lat_in = nullptr;
  }
  mono::AttentionOutputChain c;
  c.num_heads = static_cast<int32_t>(at.dims().num_heads);
  c.kv_lora = static_cast<int32_t>(at.dims().kv_lora);
  c.qk_nope = static_cast<int32_t>(at.dims().qk_nope);
  c.v_head = static_cast<int32_t>(at.dims().v_head);
  c.kv_b = at.kv_b().weight.raw();
  c.kv_b_scale = program_weight_scale(at.kv_b());
  c.partials = a.plan.part_o;
  c.lse = a.plan.part_lse;
  c.o_lat_in = a.o_lat_in;
  c.splits = a.plan.num_splits;
  c.min_split_keys = a.plan.min_split_keys;
  c.key_tile = a.plan.key_tile;
  c.token_seq = a.token_seq;
  c.query_start = a.query_start;
  c.context_lens = a.context_lens;
  c.o_lat = static_cast<uint16_t*>(s.o_lat.raw());
  c.attn_out = attn_out;
  c.width = width;
  return mono::attention_output_stages(c);
}

// The program's stages: the attention output's (with set_attention), the
// block's, then the joined front's.
std::vector<mono::Stage> stages(const MoeProgramOp& op, const State& s, int32_t width, const uint16_t* attn_out,
                                float* residual, uint16_t* delta, const FrontProgramBuffers* front,
                                const AttentionLeft* left) {
  std::vector<mono::Stage> st = mono::moe_chain_stages(chain(op, s, width, attn_out, residual, delta), kTile);
  if (op.attention())
    st = mono::join_programs(
        attention_stages(op, s, left ? *left : AttentionLeft{}, const_cast<uint16_t*>(attn_out), width), st);
  if (!op.next_front()) return st;
  return mono::join_programs(std::move(st),
                             front_program_stages(*op.next_front(), front ? *front : FrontProgramBuffers{}, width));
}

}  // namespace

Status moe_program_supports(const MoeProgramOp& op) { return moe_program_supported(op); }

Status moe_program_reserve(MoeProgramOp& op, const StepLimits& limits, Device device) {
  (void)limits;
  if (device != Device::kCuda || op.device_state()) return ok_status();
  auto s = std::make_shared<State>();
  const MoeProgramOp::Parts& p = op.parts();
  if (op.dense()) {  // the MLP's h and output, the residual (moe_chain_stages without routed experts)
    const int64_t H = op.hidden(), inter = p.down->weight().in_features;
    s->h_shared = Tensor::empty({mono::kMaxWidth * inter}, DType::kBF16, Device::kCuda);
    s->y_shared = Tensor::empty({mono::kMaxWidth * H}, DType::kF32, Device::kCuda);
    s->residual_out = Tensor::empty({mono::kMaxWidth * H}, DType::kF32, Device::kCuda);
    if (op.attention())
      s->o_lat = Tensor::empty({mono::kMaxWidth * op.attention()->dims().num_heads * op.attention()->dims().kv_lora},
                               DType::kBF16, Device::kCuda);
    const State& state = *s;
    s->runner.reserve(
        [&](int32_t width) { return stages(op, state, width, nullptr, nullptr, nullptr, nullptr, nullptr); });
    op.device_state() = s;
    return ok_status();
  }
  const kernels::MoeRoutingParams& r = p.route->params();
  const auto& ex = p.experts->experts();
  const int64_t E = r.num_experts, H = op.hidden(), inter = ex[0].down->in_features;
  const int64_t pieces = std::max<int64_t>(1, op.shared_pieces());
  const int64_t shared_inter = op.shared_pieces() > 0 ? ex[E].down->in_features : 16;
  const int64_t slots = std::min<int64_t>(mono::kMaxWidth * r.top_k, E);
  s->logits = Tensor::empty({mono::kMaxWidth * E}, DType::kF32, Device::kCuda);
  s->table = Tensor::empty({static_cast<int64_t>(sizeof(mono::RouteTable) / 4)}, DType::kI32, Device::kCuda);
  s->h = Tensor::empty({slots * mono::kMaxWidth * inter}, DType::kBF16, Device::kCuda);
  s->y = Tensor::empty({slots * mono::kMaxWidth * H}, DType::kF32, Device::kCuda);
  s->h_shared = Tensor::empty({pieces * mono::kMaxWidth * shared_inter}, DType::kBF16, Device::kCuda);
  s->y_shared = Tensor::empty({pieces * mono::kMaxWidth * H}, DType::kF32, Device::kCuda);
  s->residual_out = Tensor::empty({mono::kMaxWidth * H}, DType::kF32, Device::kCuda);
  if (op.attention())
    s->o_lat = Tensor::empty({mono::kMaxWidth * op.attention()->dims().num_heads * op.attention()->dims().kv_lora},
                             DType::kBF16, Device::kCuda);
  std::vector<const LinearWeight*> gu, dn, sgu, sdn;
  for (int64_t e = 0; e < static_cast<int64_t>(ex.size()); ++e) {
    (e < E ? gu : sgu).push_back(ex[e].gate_up);
    (e < E ? dn : sdn).push_back(ex[e].down);
  }
  s->gate_up_table = pointer_table(gu);
  s->down_table = pointer_table(dn);
  s->shared_gate_up_table = pointer_table(sgu);
  s->shared_down_table = pointer_table(sdn);
  s->gate_up_scales = pointer_table(gu, true);
  s->down_scales = pointer_table(dn, true);
  s->shared_gate_up_scales = pointer_table(sgu, true);
  s->shared_down_scales = pointer_table(sdn, true);
  const State& state = *s;
  s->runner.reserve(
      [&](int32_t width) { return stages(op, state, width, nullptr, nullptr, nullptr, nullptr, nullptr); });
  op.device_state() = s;
  return ok_status();
}

void moe_program(MoeProgramOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const int64_t rows = in[0].dim(0);
  if (rows == 0) return;
  auto* s = static_cast<State*>(op.device_state().get());
  if (!s && rows <= op.max_rows() && op.attention())  // the attention left its output to a program that cannot run
    return ctx.fail(failed_precondition("moe_program (layer " + std::to_string(op.layer()) +
                                        ") runs the attention's output but was not reserved"));
  if (rows > op.max_rows() || !s) {
    run_parts(op, ctx, in, out);
    if (ctx.error.ok() && op.next_front()) op.next_front()->run(ctx, front_in(out), front_out(op, out));
    return;
  }
  NUCLEUS_CHECK(in[1].raw() == out[0].raw(), "moe_program: the residual must be updated in place");
  const auto* attn_out = static_cast<const uint16_t*>(in[0].raw());
  float* residual = static_cast<float*>(in[1].raw());
  auto* delta = static_cast<uint16_t*>(out[1].raw());
  std::vector<const void*> key = {attn_out, residual, delta};
  FrontProgramBuffers front;
  if (op.next_front()) {
    front = front_program_buffers(*op.next_front(), ctx, front_in(out), front_out(op, out));
    for (const void* b : front_program_buffer_key(front)) key.push_back(b);
  }
  AttentionLeft left;
  if (attention_in_program(op)) {  // the front program's partials
    left.program_partials = op.attention_buffer()->partials.data<float>();
    left.token_seq = ctx.dev->token_seq;
    left.query_start = ctx.dev->query_start;
    left.context_lens = ctx.dev->context_lens;
    for (const void* b : {static_cast<const void*>(left.program_partials), static_cast<const void*>(left.token_seq),
                          static_cast<const void*>(left.query_start), static_cast<const void*>(left.context_lens)})
      key.push_back(b);
  } else if (op.attention()) {
    left.plan = mla_decode_nucleus_split_plan(*op.attention(), rows, ctx.workspace.data);
    left.o_lat_in = static_cast<const uint16_t*>(in[2].raw());
    left.token_seq = ctx.dev->token_seq;
    left.query_start = ctx.dev->query_start;
    left.context_lens = ctx.dev->context_lens;
    for (const void* b : {static_cast<const void*>(left.plan.part_o), static_cast<const void*>(left.o_lat_in),
                          static_cast<const void*>(left.token_seq), static_cast<const void*>(left.query_start),
                          static_cast<const void*>(left.context_lens)})
      key.push_back(b);
    for (int v : {left.plan.num_splits, left.plan.min_split_keys, left.plan.key_tile})
      key.push_back(reinterpret_cast<const void*>(static_cast<intptr_t>(v)));
  }
  const bool launched = s->runner.launch(
      ctx, rows, key,
      [&](int32_t width) { return stages(op, *s, width, attn_out, residual, delta, &front, &left); },
      "moe_program (layer " + std::to_string(op.layer()) +
          (op.next_front() ? " + the front of layer " + std::to_string(op.next_front()->layer()) : "") + ", " +
          std::to_string(rows) + " rows)");
  if (!launched) return;
  cudaStream_t stream = cuda::context().stream;
  if (ctx.stats && !op.dense()) {  // the routed experts the step activated (benchmarks; syncs)
    mono::RouteTable t;
    if (cudaMemcpyAsync(&t, s->table.raw(), sizeof(t), cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess)
      return ctx.fail(internal_error("moe_program: reading the route table for the step's statistics failed"));
    ctx.stats->moe_layers += 1;
    ctx.stats->experts_activated += t.count;
  }
}

}  // namespace nucleus::cuda_ops
