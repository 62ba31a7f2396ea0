// The cuda_grouped backend of moe_experts: device-side token permutation, a
// grouped tensor-core GEMM per phase (UP with SwiGLU, DOWN), a deterministic
// weighted combine (kernels/moe/moe_grouped.cuh).
//
// State: the op's device_state() holds a host object (State) that owns the
// experts' device weight views and a reference to a device workspace. The
// workspace (sorted pairs, m-tile work list, h and y rows) is shared by every
// op of the process whose sizes it fits: the ops run one after another on the
// engine stream, so one layer's scratch is free when the next layer runs. All
// of it is allocated on an op's first run; later runs (and CUDA-graph
// captures of them) never allocate. A step with more tokens than the
// workspace holds runs in chunks of that many tokens.
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/knobs.h"
#include "kernels/moe/moe_grouped.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "ops/basic_ops_cuda.h"
#include "ops/linear_cuda.h"
#include "ops/moe_cuda.h"
#include "ops/moe_decode.h"
#include "ops/skinny.h"
#include "ops/op_cuda_check.h"

namespace nucleus::cuda_ops {

namespace {

// Tokens per pass when nothing larger is asked for: prefill steps up to this
// size read each expert's weights once per m-tile rather than once per chunk.
// NUCLEUS_MOE_CHUNK_TOKENS=N overrides it (tests use it to force chunking).
constexpr int64_t kDefaultCapacityTokens = 4096;

struct State {
  Tensor views;  // device kernels::ExpertView [num_experts]
  kernels::MoeGroupedShape shape;
  bool gate_up_fp8 = false, down_fp8 = false;
  int64_t chunk_tokens = 0;  // tokens per pass (the workspace's size); 0: not reserved
};

kernels::MoeGroupedShape shape_of(const MoeExpertsOp& op) {
  const LinearWeight& gu = *op.experts().front().gate_up;
  const LinearWeight& dn = *op.experts().front().down;
  return {gu.in_features, op.inter(), static_cast<int64_t>(op.experts().size()), op.top_k(),
          gu.fp8() ? gu.block_k : 0, dn.fp8() ? dn.block_k : 0};
}

// Tokens per pass for steps of at most `max_tokens` rows: all of them, at
// least kDefaultCapacityTokens (NUCLEUS_MOE_CHUNK_TOKENS overrides), within
// the kernels' 32-bit offsets.
int64_t chunk_tokens_for(const MoeExpertsOp& op, int64_t max_tokens) {
  const kernels::MoeGroupedShape shape = shape_of(op);
  int64_t capacity = std::max(max_tokens, kDefaultCapacityTokens);
  // Checked at model creation (DeepseekModel::env_status); a value that does not parse is not used.
  if (auto v = env_string(Knob::kMoeChunkTokens))
    if (const auto n = parse_int(*v)) capacity = std::max<int64_t>(1, *n);
  const int64_t max_pairs = ((int64_t{1} << 31) - 1) / std::max(shape.hidden, shape.inter);  // 32-bit offsets
  return std::min(capacity, max_pairs / op.top_k());
}

// Built at reservation: the experts' device views.
State& state_of(MoeExpertsOp& op) {
  Tensor& holder = op.device_state();
  if (holder.defined()) return *holder.data<State>();
  auto st = std::make_shared<State>();
  std::vector<kernels::ExpertView> host;
  for (const auto& e : op.experts()) host.push_back({weight_view(*e.gate_up), weight_view(*e.down)});
  const auto bytes = static_cast<int64_t>(host.size() * sizeof(kernels::ExpertView));
  st->views = Tensor::empty({bytes}, DType::kU8, Device::kCuda);
  copy_to_device(st->views.raw(), host.data(), static_cast<size_t>(bytes));
  st->shape = shape_of(op);
  st->gate_up_fp8 = op.experts().front().gate_up->fp8();
  st->down_fp8 = op.experts().front().down->fp8();
  holder = Tensor::wrap(st.get(), {static_cast<int64_t>(sizeof(State))}, DType::kU8, Device::kCpu, st);
  return *st;
}

}  // namespace

Status moe_experts_grouped_supports(const MoeExpertsOp& op) {
  if (op.experts().empty()) return unsupported("no experts");
  const LinearWeight& gu0 = *op.experts().front().gate_up;
  const LinearWeight& dn0 = *op.experts().front().down;
  for (const LinearWeight* w : {&gu0, &dn0}) {
    const DType t = w->weight.dtype();
    if (t != DType::kBF16 && t != DType::kF8E4M3)
      return unsupported(std::string("expert weight dtype ") + dtype_name(t) + " (needs BF16 or F8E4M3)");
    if (w->weight.device() != Device::kCuda) return unsupported("expert weights not on the GPU");
  }
  for (const auto& e : op.experts()) {
    for (auto [w, w0] : {std::pair{e.gate_up, &gu0}, std::pair{e.down, &dn0}}) {
      if (w->weight.dtype() != w0->weight.dtype() || w->out_features != w0->out_features ||
          w->in_features != w0->in_features || w->block_n != w0->block_n || w->block_k != w0->block_k)
        return unsupported("experts differ in weight dtype, shape or FP8 blocks (" + w->name + ")");
    }
  }
  if (const char* why = kernels::moe_grouped_unsupported(shape_of(op), weight_view(gu0), weight_view(dn0)))
    return unsupported(why);
  return ok_status();
}

size_t moe_experts_grouped_workspace(const MoeExpertsOp& op, const StepLimits& limits) {
  return kernels::moe_grouped_workspace_bytes(shape_of(op), chunk_tokens_for(op, limits.max_tokens) * op.top_k());
}

Status moe_experts_grouped_reserve(MoeExpertsOp& op, const StepLimits& limits, Device) {
  state_of(op).chunk_tokens = chunk_tokens_for(op, limits.max_tokens);
  return ok_status();
}

const kernels::ExpertView* moe_experts_grouped_views(MoeExpertsOp& op) {
  return state_of(op).views.data<kernels::ExpertView>();
}

void moe_experts_grouped(MoeExpertsOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const Tensor& x = in[0];
  const int64_t T = x.dim(0), hidden = x.dim(1), top_k = op.top_k();
  if (T == 0) return;
  State& st = state_of(op);
  if (st.chunk_tokens == 0)
    return ctx.fail(failed_precondition("cuda_grouped moe_experts run before its reservation (StepResources)"));
  NUCLEUS_CHECK(kernels::moe_grouped_workspace_bytes(st.shape, st.chunk_tokens * top_k) <= ctx.workspace.bytes,
                "moe_experts: step workspace of {} bytes too small for {} tokens per pass", ctx.workspace.bytes,
                st.chunk_tokens);
  const kernels::MoeGroupedWorkspace ws =
      kernels::moe_grouped_workspace_carve(ctx.workspace.data, st.shape, st.chunk_tokens * top_k);
  NUCLEUS_CHECK(hidden == st.shape.hidden, "moe_experts x width {} vs hidden {}", hidden, st.shape.hidden);
  // Read at every run (a capture bakes in the kernels it launched).
  kernels::MoeGroupedOptions opt;
  opt.fp8_register_dequant = env_flag(Knob::kMoeFp8RegisterDequant);
  opt.up_splits = std::max(0, moe_up_splits_switch());
  opt.deep_ring = moe_deep_ring_switch();
  opt.align_free = moe_align_free_switch();
  opt.combine_prefetch = moe_combine_prefetch_switch();
  opt.up_stream = moe_up_stream_switch();
  opt.wgmma = moe_wgmma_switch();
  opt.fp8_w8a8 = moe_fp8_w8a8_switch();
  opt.pdl = skinny_pdl();
  // The add + norm after the op (MoeExpertsOp::fuse_add_rmsnorm) in each
  // chunk's combine; the prezero fill in the first chunk's.
  kernels::AddRmsNormParams fill;
  if (op.fuses_add_rmsnorm() && op.prezero().n_total > 0) {
    fill.rows = std::min(st.chunk_tokens, T);
    set_prezero_fill(op.prezero(), out[4], fill);
  }
  for (int64_t t0 = 0; t0 < T; t0 += st.chunk_tokens) {
    const int64_t n = std::min(st.chunk_tokens, T - t0);
    kernels::MoeCombineNorm norm;
    if (op.fuses_add_rmsnorm()) {
      norm.residual = out[2].data<float>() + t0 * hidden;
      norm.w = op.norm_weight().data<float>();
      norm.eps = op.norm_eps();
      norm.normed = out[3].data<__nv_bfloat16>() + t0 * hidden;
      if (t0 == 0) {
        norm.zero_fill = fill.zero_fill;
        norm.zero_fill_count = fill.zero_fill_count;
        norm.fill_blocks = fill.fill_blocks;
      }
    }
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_moe_grouped(
        x.data<__nv_bfloat16>() + t0 * hidden, n, in[1].data<int32_t>() + t0 * top_k,
        in[2].data<float>() + t0 * top_k, st.shape, st.views.data<kernels::ExpertView>(), st.gate_up_fp8,
        st.down_fp8, ws, out[0].data<__nv_bfloat16>() + t0 * hidden, cuda::context().stream, opt, norm));
  }
}

void moe_experts_add_rmsnorm(MoeExpertsOp& op, const TensorList& out) {
  if (!op.fuses_add_rmsnorm()) return;
  kernels::AddRmsNormParams p;
  p.residual = out[2].data<float>();
  p.delta = out[0].raw();
  p.w = op.norm_weight().data<float>();
  p.rows = out[2].dim(0);
  p.width = out[2].dim(1);
  p.eps = op.norm_eps();
  p.out = out[3].data<__nv_bfloat16>();
  p.pdl = small_ops_pdl();
  if (op.prezero().n_total > 0) set_prezero_fill(op.prezero(), out[4], p);
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_add_rmsnorm(p, cuda::context().stream));
}

}  // namespace nucleus::cuda_ops
