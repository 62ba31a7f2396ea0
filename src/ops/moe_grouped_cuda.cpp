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
#include "core/env.h"
#include "kernels/moe/moe_grouped.cuh"
#include "ops/cuda_backends.h"
#include "ops/op_cuda_check.h"

namespace nucleus::cuda_ops {

namespace {

// Tokens per pass when nothing larger is asked for: prefill steps up to this
// size read each expert's weights once per m-tile rather than once per chunk.
// NUCLEUS_MOE_CHUNK_TOKENS=N overrides it (tests use it to force chunking).
constexpr int64_t kDefaultCapacityTokens = 4096;

struct Workspace {
  kernels::MoeGroupedShape shape;  // the largest sizes it serves
  int64_t max_pairs = 0;
  Tensor storage;
  kernels::MoeGroupedWorkspace ptrs;

  bool fits(const kernels::MoeGroupedShape& s, int64_t pairs) const {
    return s.num_experts <= shape.num_experts && s.hidden <= shape.hidden && s.inter <= shape.inter &&
           pairs <= max_pairs;
  }
};

// The device's most recent workspace when it fits, else a new one at least
// as large as both (the old one lives on while ops that hold it do).
std::shared_ptr<Workspace> shared_workspace(const kernels::MoeGroupedShape& s, int64_t pairs) {
  static std::mutex mu;
  static std::weak_ptr<Workspace> latest_per_device[cuda::kMaxDevices];  // one thread per GPU under TP
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<Workspace>& latest = latest_per_device[cuda::thread_device()];
  auto old = latest.lock();
  if (old && old->fits(s, pairs)) return old;
  auto w = std::make_shared<Workspace>();
  w->shape = s;
  w->max_pairs = pairs;
  if (old) {
    w->shape.num_experts = std::max(w->shape.num_experts, old->shape.num_experts);
    w->shape.hidden = std::max(w->shape.hidden, old->shape.hidden);
    w->shape.inter = std::max(w->shape.inter, old->shape.inter);
    w->max_pairs = std::max(w->max_pairs, old->max_pairs);
  }
  const size_t bytes = kernels::moe_grouped_workspace_bytes(w->shape, w->max_pairs);
  w->storage = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kU8, Device::kCuda);
  w->ptrs = kernels::moe_grouped_workspace_carve(w->storage.raw(), w->shape, w->max_pairs);
  latest = w;
  return w;
}

struct State {
  Tensor views;  // device kernels::ExpertView [num_experts]
  std::shared_ptr<Workspace> workspace;
  kernels::MoeGroupedShape shape;
  bool gate_up_fp8 = false, down_fp8 = false;
  int64_t chunk_tokens = 0;
};

kernels::MoeGroupedShape shape_of(const MoeExpertsOp& op) {
  const LinearWeight& gu = *op.experts().front().gate_up;
  return {gu.in_features, op.inter(), static_cast<int64_t>(op.experts().size()), op.top_k()};
}

// Built on the first run (num_tokens: that run's rows; scratch_rows: the
// rows of the op's scratch buffer, the engine's per-pass token count).
State& state_of(MoeExpertsOp& op, int64_t num_tokens, int64_t scratch_rows) {
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
  int64_t capacity = std::max({num_tokens, scratch_rows, kDefaultCapacityTokens});
  if (auto v = env_string("NUCLEUS_MOE_CHUNK_TOKENS")) capacity = std::max<int64_t>(1, std::stoll(*v));
  const int64_t max_pairs = ((int64_t{1} << 31) - 1) / std::max(st->shape.hidden, st->shape.inter);  // 32-bit offsets
  st->chunk_tokens = std::min(capacity, max_pairs / op.top_k());
  st->workspace = shared_workspace(st->shape, st->chunk_tokens * op.top_k());
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

void moe_experts_grouped(MoeExpertsOp& op, OpContext&, const TensorList& in, const TensorList& out) {
  const Tensor& x = in[0];
  const int64_t T = x.dim(0), hidden = x.dim(1), top_k = op.top_k();
  if (T == 0) return;
  State& st = state_of(op, T, out[1].dim(0));
  NUCLEUS_CHECK(hidden == st.shape.hidden, "moe_experts x width {} vs hidden {}", hidden, st.shape.hidden);
  for (int64_t t0 = 0; t0 < T; t0 += st.chunk_tokens) {
    const int64_t n = std::min(st.chunk_tokens, T - t0);
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_moe_grouped(
        x.data<__nv_bfloat16>() + t0 * hidden, n, in[1].data<int32_t>() + t0 * top_k,
        in[2].data<float>() + t0 * top_k, st.shape, st.views.data<kernels::ExpertView>(), st.gate_up_fp8,
        st.down_fp8, st.workspace->ptrs, out[0].data<__nv_bfloat16>() + t0 * hidden, cuda::context().stream));
  }
}

}  // namespace nucleus::cuda_ops
