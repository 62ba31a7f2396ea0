// CUDA backend of the front_program op (ops/front_program_cuda.h).
#include "ops/front_program_cuda.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "core/cuda/context.h"
#include "core/device.h"
#include "kernels/common/device_sms.h"
#include "kernels/mono/mono_program_ref.h"
#include "ops/mla_attention.h"
#include "ops/decode_program.h"
#include "ops/decode_program_cuda.h"

namespace nucleus::cuda_ops {

namespace {

namespace mono = kernels::mono;

constexpr int32_t kTile = 16;  // columns a GEMV job owns (docs/decode_program.md)

struct State {
  DecodeProgramRunner runner;
  Tensor residual_out;  // [8, hidden] f32: the new residual, copied back by the RoPE stage
  Tensor w_uk_t;        // [heads, kv_lora, qk_nope] bf16 or e4m3 (as kv_b) when the op absorbs (FrontChain::w_uk_t)
  Tensor w_uk_t_scale;  // e4m3: [heads, kv_lora / 128, qk_nope / 128] f32
};

constexpr int32_t kAbsorbTile = 64;  // columns of q_lat an absorption job owns (16 KB of W_UK^T at qk_nope 128)

// W_UK^T of every head from kv_b_proj [heads * (qk_nope + v_head), kv_lora]
// (device): [heads, kv_lora, qk_nope], through the host once at reserve, in
// kv_b's type: bf16, or e4m3 with the transposed 128 x 128 blocks' scales
// (mono::transpose_w_uk, transpose_w_uk_scale; qk_nope and v_head multiples
// of 128, front_program_supported's condition).
template <typename T>
Tensor transposed_w_uk(const LinearWeight& kv_b, const kernels::MlaDims& d, DType dtype) {
  std::vector<T> w(static_cast<size_t>(d.num_heads * (d.qk_nope + d.v_head) * d.kv_lora));
  copy_to_host(w.data(), kv_b.weight.raw(), w.size() * sizeof(T));
  const std::vector<T> t = mono::transpose_w_uk(w.data(), d.num_heads, d.qk_nope, d.v_head, d.kv_lora);
  Tensor out = Tensor::empty({static_cast<int64_t>(t.size())}, dtype, Device::kCuda);
  copy_to_device(out.raw(), t.data(), t.size() * sizeof(T));
  return out;
}
Tensor transposed_w_uk_scale(const LinearWeight& kv_b, const kernels::MlaDims& d) {
  std::vector<float> sc(static_cast<size_t>(kv_b.scale_inv.numel()));
  copy_to_host(sc.data(), kv_b.scale_inv.raw(), sc.size() * sizeof(float));
  const std::vector<float> t = mono::transpose_w_uk_scale(sc.data(), d.num_heads, d.qk_nope, d.v_head, d.kv_lora);
  Tensor out = Tensor::empty({static_cast<int64_t>(t.size())}, DType::kF32, Device::kCuda);
  copy_to_device(out.raw(), t.data(), t.size() * sizeof(float));
  return out;
}

mono::FrontChain chain(const FrontProgramOp& op, const State& s, const FrontProgramBuffers& st) {
  const FrontProgramOp::Parts& p = op.parts();
  const RopeKvCacheWriteOp& r = *p.rope;
  mono::FrontChain c;
  c.hidden = op.hidden();
  c.num_heads = static_cast<int32_t>(r.dims().num_heads);
  c.qk_nope = static_cast<int32_t>(r.dims().qk_nope);
  c.qk_rope = static_cast<int32_t>(r.dims().qk_rope);
  c.kv_lora = static_cast<int32_t>(r.dims().kv_lora);
  c.eps = p.norm->eps();
  c.kv_eps = r.kv_norm_eps();
  c.attention_factor = r.attention_factor();
  if (p.q_a) {
    c.q_lora = p.q_a->weight().out_features;
    c.w_qa = p.q_a->weight().weight.raw();
    c.w_qb = p.q_b->weight().weight.raw();
    c.qa_scale = program_weight_scale(p.q_a->weight());
    c.qb_scale = program_weight_scale(p.q_b->weight());
    c.q_a_norm = p.q_a_norm->weight().data<float>();
    c.q_a_eps = p.q_a_norm->eps();
    c.q_a = st.q_a;
  } else {
    c.w_q = p.q_proj->weight().weight.raw();
    c.q_scale = program_weight_scale(p.q_proj->weight());
  }
  c.w_kva = p.kv_a->weight().weight.raw();
  c.kva_scale = program_weight_scale(p.kv_a->weight());
  c.input_norm = p.norm->weight().data<float>();
  c.kv_norm = r.kv_norm_weight().data<float>();
  c.inv_freq = r.inv_freq_device();
  c.residual = st.residual;
  c.delta = op.has_delta() ? st.delta : nullptr;
  c.residual_out = op.has_delta() ? s.residual_out.data<float>() : nullptr;
  c.residual_copy_to = op.has_delta() ? st.residual : nullptr;
  c.q = st.q;
  c.kv_a = st.kv_a;
  c.positions = st.positions;
  c.slot_mapping = st.slot_mapping;
  c.cache = st.cache;
  c.num_slots = st.num_slots;
  if (op.absorbs()) {
    c.w_uk_t = s.w_uk_t.raw();
    c.uk_t_scale = s.w_uk_t_scale.defined() ? s.w_uk_t_scale.data<float>() : nullptr;
    c.q_full = st.q_full;
    c.absorb_tile = kAbsorbTile;
  }
  return c;
}

void run_parts(FrontProgramOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  FrontProgramOp::Parts& p = op.parts();
  p.norm->run(ctx, op.has_delta() ? TensorList{in[0], in[1]} : TensorList{in[0]}, {out[0], out[1]});
  if (!ctx.error.ok()) return;
  if (p.q_a) {
    p.q_a->run(ctx, {out[1]}, {out[4]});
    if (!ctx.error.ok()) return;
    p.q_a_norm->run(ctx, {out[4]}, {out[4]});
    if (!ctx.error.ok()) return;
    p.q_b->run(ctx, {out[4]}, {out[2]});
  } else {
    p.q_proj->run(ctx, {out[1]}, {out[2]});
  }
  if (!ctx.error.ok()) return;
  p.kv_a->run(ctx, {out[1]}, {out[3]});
  if (!ctx.error.ok()) return;
  p.rope->run(ctx, {out[2], out[3]}, {out[2]});
}

}  // namespace

FrontProgramBuffers front_program_buffers(const FrontProgramOp& op, const OpContext& ctx, const TensorList& in,
                                          const TensorList& out) {
  NUCLEUS_CHECK(in[0].raw() == out[0].raw(), "front_program: the residual must be updated in place");
  const KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.parts().rope->cache_dtype(), "front_program");
  FrontProgramBuffers b;
  b.residual = static_cast<float*>(in[0].raw());
  b.delta = op.has_delta() ? static_cast<const uint16_t*>(in[1].raw()) : nullptr;
  b.q = static_cast<uint16_t*>(out[2].raw());
  b.kv_a = static_cast<uint16_t*>(out[3].raw());
  b.q_a = op.parts().q_a ? static_cast<uint16_t*>(out[4].raw()) : nullptr;
  const size_t q_full_at = op.parts().q_a ? 5 : 4;
  b.q_full = op.absorbs() ? static_cast<uint16_t*>(out[q_full_at].raw()) : nullptr;
  if (op.attends()) {
    b.partials = op.attend_buffer()->partials.data<float>();
    b.block_tables = ctx.dev->block_tables;
    b.token_seq = ctx.dev->token_seq;
    b.query_start = ctx.dev->query_start;
    b.context_lens = ctx.dev->context_lens;
    b.max_blocks = static_cast<int32_t>(ctx.inputs->max_blocks_per_seq);
    b.block_size = static_cast<int32_t>(kv.block_size);
  }
  b.positions = ctx.dev->positions;
  b.slot_mapping = ctx.dev->slot_mapping;
  b.cache = static_cast<uint16_t*>(kv.layer_data(op.layer()));
  b.num_slots = kv.num_slots();
  return b;
}

std::vector<mono::Stage> front_program_stages(const FrontProgramOp& op, const FrontProgramBuffers& b, int32_t width) {
  const auto* s = static_cast<const State*>(op.device_state().get());
  NUCLEUS_CHECK(s != nullptr, "front_program (layer {}): stages asked for before reserve", op.layer());
  mono::FrontChain c = chain(op, *s, b);
  mono::AttentionOutputChain at;
  if (op.attends()) {  // the attention's kAttend stage after RoPE (what the layer's MoE program merges)
    const kernels::MlaDims& d = op.parts().rope->dims();
    at.num_heads = static_cast<int32_t>(d.num_heads);
    at.kv_lora = static_cast<int32_t>(d.kv_lora);
    at.qk_rope = static_cast<int32_t>(d.qk_rope);
    const mono::ProgramAttentionPlan plan =
        mono::program_attention_plan(width, at.num_heads, at.kv_lora, kernels::current_device_sms(), b.partials);
    at.splits = plan.splits;
    at.min_split_keys = mono::kProgramAttentionMinSplitKeys;
    at.key_tile = mono::kProgramAttentionKeyTile;
    at.width = width;
    at.attention = true;
    at.q_full = b.q_full;
    at.cache = b.cache;
    at.num_slots = b.num_slots;
    at.block_tables = b.block_tables;
    at.max_blocks = b.max_blocks;
    at.block_size = b.block_size;
    at.token_seq = b.token_seq;
    at.query_start = b.query_start;
    at.context_lens = b.context_lens;
    at.scale = op.attend_scale();
    at.part_o = plan.part_o;
    at.part_lse = plan.part_lse;
    c.attend = &at;
  }
  return mono::front_chain_stages(c, kTile);
}

std::vector<const void*> front_program_buffer_key(const FrontProgramBuffers& b) {
  return {b.residual,  b.delta,     b.q,           b.kv_a,        b.q_a,          b.q_full,
          b.partials,  b.positions, b.slot_mapping, b.cache,      b.block_tables, b.token_seq,
          b.query_start, b.context_lens, reinterpret_cast<const void*>(static_cast<intptr_t>(b.max_blocks)),
          reinterpret_cast<const void*>(static_cast<intptr_t>(b.block_size))};
}

Status front_program_supports(const FrontProgramOp& op) { return front_program_supported(op); }

Status front_program_reserve(FrontProgramOp& op, const StepLimits& limits, Device device) {
  (void)limits;
  if (device != Device::kCuda || op.device_state()) return ok_status();
  auto s = std::make_shared<State>();
  s->residual_out = Tensor::empty({mono::kMaxWidth * op.hidden()}, DType::kF32, Device::kCuda);
  if (op.absorbs()) {
    const LinearWeight& kv_b = *op.parts().kv_b;
    const kernels::MlaDims& d = op.parts().rope->dims();
    if (kv_b.fp8()) {
      s->w_uk_t = transposed_w_uk<uint8_t>(kv_b, d, DType::kF8E4M3);
      s->w_uk_t_scale = transposed_w_uk_scale(kv_b, d);
    } else {
      s->w_uk_t = transposed_w_uk<uint16_t>(kv_b, d, DType::kBF16);
    }
  }
  if (op.attends() && !op.attend_buffer()->partials.defined()) {  // the graph's one buffer, made by its first front
    const kernels::MlaDims& d = op.parts().rope->dims();
    op.attend_buffer()->partials =
        Tensor::empty({mono::program_attention_floats(static_cast<int32_t>(d.num_heads), static_cast<int32_t>(d.kv_lora),
                                                      kernels::current_device_sms())},
                      DType::kF32, Device::kCuda);
  }
  op.device_state() = s;
  s->runner.reserve([&](int32_t width) { return front_program_stages(op, FrontProgramBuffers{}, width); });
  return ok_status();
}

void front_program(FrontProgramOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const int64_t rows = in[0].dim(0);
  if (rows == 0) return;
  auto* s = static_cast<State*>(op.device_state().get());
  if (!s && rows <= op.max_rows() && op.absorbs())  // the attention would read an absorbed query never written
    return ctx.fail(failed_precondition("front_program (layer " + std::to_string(op.layer()) +
                                        ") absorbs the query but was not reserved"));
  if (rows > op.max_rows() || !s) return run_parts(op, ctx, in, out);
  const FrontProgramBuffers b = front_program_buffers(op, ctx, in, out);
  s->runner.launch(ctx, rows, front_program_buffer_key(b),
                   [&](int32_t width) { return front_program_stages(op, b, width); },
                   "front_program (layer " + std::to_string(op.layer()) + ", " + std::to_string(rows) + " rows)");
}

}  // namespace nucleus::cuda_ops
