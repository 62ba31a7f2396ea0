#include <algorithm>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "kernels/mla/gather_kv_b_proj.cuh"
#include "kernels/mla/mla_attention_naive.cuh"
#include "kernels/rope/rope_kv_cache.cuh"
#include "ops/linear_cuda.h"
#include "ops/mla_decode_cuda.h"
#include "ops/rope_kv_cache_write_cuda.h"
#include "ops/mla_prefill_cuda.h"
#include "ops/op_cuda_check.h"

namespace nucleus::cuda_ops {

namespace {
cudaStream_t stream() { return cuda::context().stream; }

kernels::MlaShape shape_of(const kernels::MlaDims& d) {
  kernels::MlaShape s;
  s.num_heads = static_cast<int>(d.num_heads);
  s.qk_nope = static_cast<int>(d.qk_nope);
  s.qk_rope = static_cast<int>(d.qk_rope);
  s.v_head = static_cast<int>(d.v_head);
  s.kv_lora = static_cast<int>(d.kv_lora);
  s.scale = d.scale;
  return s;
}

// Grows `t` to `shape`; kResourceExhausted when the device has no room (the
// step fails, the process goes on).
Status ensure(Tensor& t, std::vector<int64_t> shape, DType dtype) {
  if (t.defined() && t.numel() >= shape_numel(shape)) return ok_status();
  t = Tensor();  // the old buffer goes first, so its memory counts toward the new one
  NUCLEUS_ASSIGN_OR_RETURN(t, try_empty(std::move(shape), dtype, Device::kCuda, "mla_prefill cuda_naive scratch"));
  return ok_status();
}

constexpr int64_t kQueryGroup = 512;           // query rows per expanded launch
constexpr int64_t kKvBudgetBytes = 256ll << 20;  // expanded K/V scratch
}  // namespace

Status cuda_cache_dtype_supported(KvCacheDtype d) {
  if (d == KvCacheDtype::kBF16 || d == KvCacheDtype::kFp8E4M3) return ok_status();
  return unsupported(std::string("KV cache dtype ") + kv_cache_dtype_name(d) +
                     ": the CUDA kernels store and read bf16 or fp8_e4m3 rows");
}

Status rope_kv_cache_write_supports(const RopeKvCacheWriteOp& op) { return cuda_cache_dtype_supported(op.cache_dtype()); }

void rope_kv_cache_write(RopeKvCacheWriteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const auto& d = op.dims();
  KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), "rope_kv_cache_write");
  kernels::RopeKvCacheParams p;
  p.q = out[0].data<__nv_bfloat16>();
  p.q_stride = out[0].row_numel();
  if (in[0].dtype() == DType::kF32) {  // a split-K GEMM's output: written whole into the bf16 q
    p.q_in = in[0].data<float>();
    p.q_in_stride = in[0].row_numel();
  } else {
    NUCLEUS_CHECK(in[0].raw() == out[0].raw(), "rope: a bf16 q is rotated in place");
  }
  p.kv_a = in[1].data<__nv_bfloat16>();
  p.kv_stride = in[1].row_numel();
  p.positions = ctx.dev->positions;
  p.slot_mapping = ctx.dev->slot_mapping;
  p.inv_freq = op.inv_freq_device();
  p.attention_factor = op.attention_factor();
  p.cache = kv.layer_data(op.layer());
  p.cache_fp8 = kv.dtype() == KvCacheDtype::kFp8E4M3;
  p.k_scale = kv.layer_k_scale(op.layer());
  p.num_tokens = in[0].dim(0);
  p.num_heads = static_cast<int>(d.num_heads);
  p.qk_nope = static_cast<int>(d.qk_nope);
  p.qk_rope = static_cast<int>(d.qk_rope);
  p.kv_lora = static_cast<int>(d.kv_lora);
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_rope_kv_cache_write(p, stream()));
}

Status mla_decode_naive_supports(const MlaDecodeAttentionOp& op) { return cuda_cache_dtype_supported(op.cache_dtype()); }

void mla_decode_naive(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const StepInputs& si = *ctx.inputs;
  const DeviceStepInputs& dev = *ctx.dev;
  KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), "mla_decode cuda_naive");
  const Tensor& q = in[0];
  const int64_t T = q.dim(0);
  // All rows (forced absorbed), or the single-token sequences' rows (auto).
  const int32_t* rows = nullptr;
  int64_t num_rows = T;
  if (op.mode() == AttentionMode::kAuto && dev.num_single_token_rows != T) {
    rows = dev.single_token_rows;
    num_rows = dev.num_single_token_rows;
  }
  const int64_t chunk_rows = out[1].dim(0);
  for (int64_t r0 = 0; r0 < num_rows; r0 += chunk_rows) {
    kernels::MlaAbsorbedParams p;
    p.s = shape_of(op.dims());
    p.q = q.data<__nv_bfloat16>();
    p.q_stride = q.row_numel();
    p.rows = rows ? rows + r0 : nullptr;
    p.row_offset = rows ? 0 : r0;
    p.num_rows = std::min(chunk_rows, num_rows - r0);
    p.token_seq = dev.token_seq;
    p.query_start = dev.query_start;
    p.context_lens = dev.context_lens;
    p.block_tables = dev.block_tables;
    p.max_blocks = si.max_blocks_per_seq;
    p.block_size = static_cast<int>(kv.block_size);
    p.cache = kv.layer_data(op.layer());
    p.cache_fp8 = kv.dtype() == KvCacheDtype::kFp8E4M3;
    p.k_scale = kv.layer_k_scale(op.layer());
    p.kv_b = weight_view(op.kv_b());
    p.q_lat = out[1].data<float>();
    p.o_lat = out[2].data<float>();
    p.out = out[0].data<__nv_bfloat16>();
    p.out_stride = out[0].row_numel();
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_absorbed_naive(p, stream()));
  }
}

Status mla_prefill_naive_supports(const MlaPrefillAttentionOp& op) {
  return cuda_cache_dtype_supported(op.cache_dtype());
}

void mla_prefill_naive(MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const StepInputs& si = *ctx.inputs;
  const DeviceStepInputs& dev = *ctx.dev;
  KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), "mla_prefill cuda_naive");
  const kernels::MlaShape s = shape_of(op.dims());
  const void* cache = kv.layer_data(op.layer());
  const DType cache_dtype = kv.data.dtype();
  const float k_scale = kv.layer_k_scale(op.layer());
  const Tensor& q = in[0];
  const Tensor& o = out[0];
  // state: latent rows, expanded K/V, running output, running LSE.
  auto& st = op.state();
  st.resize(4);
  const int64_t kv_width = s.num_heads * (s.qk_nope + s.v_head);
  const int64_t chunk = std::max<int64_t>(
      64, std::min<int64_t>(op.context_chunk(), kKvBudgetBytes / (kv_width * 2)));
  for (int64_t seq = 0; seq < si.num_seqs(); ++seq) {
    const int32_t num_q = si.query_len(seq);
    if (num_q == 0 || !serves_sequence(op.mode(), false, num_q)) continue;
    const int64_t q_begin = si.query_start[seq], ctx_len = si.context_lens[seq];
    const int32_t* table = dev.block_tables + seq * si.max_blocks_per_seq;
    for (Status e : {ensure(st[0], {chunk, s.latent()}, DType::kBF16), ensure(st[1], {chunk, kv_width}, DType::kBF16),
                     ensure(st[2], {kQueryGroup, s.num_heads, s.v_head}, DType::kF32),
                     ensure(st[3], {kQueryGroup, s.num_heads}, DType::kF32)})
      if (!e.ok()) return ctx.fail(std::move(e));
    for (int64_t i0 = 0; i0 < num_q; i0 += kQueryGroup) {
      const int64_t nq = std::min<int64_t>(kQueryGroup, num_q - i0);
      const int64_t keys = ctx_len + i0 + nq;  // causal: the group's last query sees these
      for (int64_t k0 = 0; k0 < keys; k0 += chunk) {
        const int64_t nk = std::min(chunk, keys - k0);
        // Latent rows as bf16 (an FP8 row times k_scale, rounded once).
        NUCLEUS_OP_CUDA_CHECK(kernels::launch_gather_dequant_latent(cache, cache_dtype, s.latent(), k_scale, table,
                                                                 static_cast<int>(kv.block_size), k0, nk,
                                                                 st[0].data<__nv_bfloat16>(), stream()));
        if (Status ls = linear_forward(op.kv_b(), st[0].raw(), s.latent(), nk, st[1].raw(), DType::kBF16, kv_width,
                                       false);
            !ls.ok())
          return ctx.fail(ls.with_context("mla_prefill kv_b expansion"));
        kernels::MlaExpandedPieceParams p;
        p.s = s;
        p.q = q.data<__nv_bfloat16>() + (q_begin + i0) * q.row_numel();
        p.q_stride = q.row_numel();
        p.num_q = nq;
        p.q_pos0 = ctx_len + i0;
        p.kv = st[1].data<__nv_bfloat16>();
        p.latent = st[0].data<__nv_bfloat16>();
        p.key_begin = k0;
        p.num_keys = nk;
        p.acc = st[2].data<float>();
        p.lse = st[3].data<float>();
        p.first = k0 == 0;
        NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_expanded_piece_naive(p, stream()));
      }
      NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_store_output(st[2].data<float>(), nq, s.num_heads, s.v_head,
                                                          o.data<__nv_bfloat16>() + (q_begin + i0) * o.row_numel(),
                                                          o.row_numel(), stream()));
    }
  }
}

}  // namespace nucleus::cuda_ops
