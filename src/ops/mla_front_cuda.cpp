// CUDA backend of the mla_front op: a width build when one serves the step's
// rows, else the plain chain (both in jit/mla_front_builds_cuda.cpp).
#include "core/cuda/context.h"
#include "jit/mla_front_builds.h"
#include "ops/mla_attention.h"
#include "ops/mla_front_cuda.h"

namespace nucleus::cuda_ops {

Status mla_front_supports(const MlaFrontOp& op) {
  if (!op.builds()) return unsupported("no width builds (NUCLEUS_WIDTH_BUILDS unset)");
  if (!op.barrier()) return unsupported("no grid-barrier buffer");
  if (!op.inv_freq_device()) return unsupported("no device RoPE frequencies");
  kernels::MlaDims d;
  d.num_heads = op.num_heads();
  d.qk_nope = 128;
  d.qk_rope = 64;
  d.v_head = 128;
  d.kv_lora = 512;
  return mla_front_supported(op.weights(), op.hidden(), op.q_lora(), d, op.cache_dtype());
}

void mla_front(MlaFrontOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const int64_t rows = in[0].dim(0);
  if (rows == 0) return;
  const KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), "mla_front");
  const MlaFrontOp::Weights& w = op.weights();
  auto bits = [](const Tensor& t) { return static_cast<const unsigned short*>(t.raw()); };
  auto mut = [](const Tensor& t) { return static_cast<unsigned short*>(t.raw()); };
  MlaFrontParams p{};
  p.x = bits(in[0]);
  p.x_stride = in[0].row_numel();
  p.w_qa = w.q_a ? bits(w.q_a->weight) : nullptr;
  p.qa_norm_w = w.q_a_norm ? w.q_a_norm->data<float>() : nullptr;
  p.w_qb = bits(w.q->weight);
  p.w_kva = bits(w.kv_a->weight);
  p.kva_norm_w = w.kv_a_norm->data<float>();
  p.w_kvb = bits(w.kv_b->weight);
  p.positions = ctx.dev->positions;
  p.slot_mapping = reinterpret_cast<const long long*>(ctx.dev->slot_mapping);
  p.inv_freq = op.inv_freq_device();
  p.attention_factor = op.attention_factor();
  p.eps = op.eps();
  p.cache = static_cast<unsigned short*>(kv.layer_data(op.layer()));
  p.q = mut(out[0]);
  p.q_full = mut(out[1]);
  p.kv_a = mut(out[2]);
  p.q_a = mut(out[3]);
  p.barrier = static_cast<unsigned int*>(op.barrier());
  p.rows = static_cast<int>(rows);
  p.hidden = static_cast<int>(op.hidden());
  p.q_lora = static_cast<int>(op.q_lora());
  p.num_heads = static_cast<int>(op.num_heads());
  cudaStream_t stream = cuda::context().stream;
  Status s = op.builds()->launch(p, stream);
  if (s.code() == StatusCode::kUnsupported) s = width::launch_mla_front_plain(p, out[4].raw(), stream);
  // A width build or the plain kernel refusing this call (its plan, a launch
  // configuration) fails the step, not the process.
  if (!s.ok()) ctx.fail(s.with_context("mla_front (layer " + std::to_string(op.layer()) + ", " + std::to_string(rows) + " rows)"));
}

}  // namespace nucleus::cuda_ops
