// The CUDA backends of the mla_decode op family: "nucleus" (own split-KV
// flash-decoding kernel, kernels/mla/mla_decode.cuh), "flashinfer"
// (FlashInfer's Hopper MLA kernel, kernels/mla/flashinfer_mla.cuh) and, at the
// end, "cuda_naive" (the plain absorbed-form kernel). The fast two
// share the absorption: q_lat = q_nope . W_UK and out = o_lat . W_UV, at a
// few rows a call as own kernels that read kv_b_proj as stored (bf16 or FP8
// blocks; NUCLEUS_MLA_DECODE_SMALL_GEMMS), else as cuBLASLt batched GEMMs
// over heads on a bf16 copy of an FP8 kv_b_proj made once on first use
// (op.state()[0]).
//
// Input: {q}, or {q, q_full} after the mla_front op (width builds) or a front
// program that absorbs, whose absorbed query [T, H, 576] bf16 is then read
// instead of absorbing q here (at most absorbed_input_rows() rows a step).
// Scratch: out[1] (q_lat, f32 [W, H * 512]) holds q_full bf16 [W, H, 576] and
// q_nope bf16 [W, H, 128]; out[2] (o_lat, f32 [W, H * 512]) holds o_lat bf16
// [W, H, 512] and the compact output bf16 [W, H * 128]. Rows are processed W
// at a time. The nucleus backend's split partials live in the step workspace
// (OpContext::workspace). FlashInfer plans on the host from the step's key
// counts, once per step (FlashInferDecodePlan), which a CUDA graph replay
// cannot follow: the flashinfer backend refuses an op of a captured graph.
// Caches: nucleus and cuda_naive read bf16, FP8 e4m3 (times the layer's
// k_scale) and fp8_ds_mla rows (times each tile's scale); flashinfer reads
// bf16 rows only, so it refuses an op built for either FP8 cache.
#include <algorithm>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "kernels/mla/flashinfer_mla.cuh"
#include "kernels/mla/mla_attention_naive.cuh"
#include "kernels/mla/mla_decode.cuh"
#include "ops/linear_cuda.h"
#include "ops/mla_decode_cuda.h"
#include "ops/mla_attention_cuda.h"
#include "ops/op_cuda_check.h"
#include "ops/skinny.h"

namespace nucleus::cuda_ops {

namespace {

cudaStream_t stream() { return cuda::context().stream; }

// The absorbed MLA widths the fast kernels are built for.
Status check_dims(const MlaDecodeAttentionOp& op) {
  const auto& d = op.dims();
  if (d.kv_lora != kernels::kMlaDecodeLora || d.qk_rope != kernels::kMlaDecodeRope ||
      d.qk_nope != kernels::kMlaDecodeNope || d.v_head != kernels::kMlaDecodeVHead)
    return unsupported("needs kv_lora 512, qk_rope 64, qk_nope 128, v_head 128 (got " + std::to_string(d.kv_lora) +
                       ", " + std::to_string(d.qk_rope) + ", " + std::to_string(d.qk_nope) + ", " +
                       std::to_string(d.v_head) + ")");
  if (d.num_heads < 1) return unsupported("no heads");
  const DType w = op.kv_b().weight.dtype();
  if (w != DType::kBF16 && w != DType::kF8E4M3)
    return unsupported(std::string("kv_b_proj weight dtype ") + dtype_name(w) + " (needs BF16 or F8E4M3)");
  if (op.kv_b().out_features != d.num_heads * (d.qk_nope + d.v_head) || op.kv_b().in_features != d.kv_lora)
    return unsupported("kv_b_proj shape does not match num_heads * (qk_nope + v_head) x kv_lora");
  return ok_status();
}

// kv_b_proj as bf16 [H * 256, 512]: the weight itself, or its dequantized copy.
const __nv_bfloat16* kv_b_bf16(MlaDecodeAttentionOp& op) {
  const LinearWeight& w = op.kv_b();
  if (!w.fp8()) return w.weight.data<__nv_bfloat16>();
  auto& st = op.state();
  if (st.empty()) st.resize(1);
  if (!st[0].defined()) {
    st[0] = Tensor::empty({w.out_features, w.in_features}, DType::kBF16, Device::kCuda);
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_decode_dequant_weight(weight_view(w), st[0].data<__nv_bfloat16>(),
                                                                 stream()));
  }
  return st[0].data<__nv_bfloat16>();
}

// The rows the op serves this step: all T rows (forced absorbed, or every
// sequence is single-token), else the single-token rows (auto).
struct RowSet {
  const int32_t* rows = nullptr;  // device list, or null: rows 0 .. num_rows - 1
  int64_t num_rows = 0;
};
RowSet row_set(const MlaDecodeAttentionOp& op, const OpContext& ctx, int64_t T) {
  const DeviceStepInputs& dev = *ctx.dev;
  if (op.mode() == AttentionMode::kAuto && dev.num_single_token_rows != T)
    return {dev.single_token_rows, dev.num_single_token_rows};
  return {nullptr, T};
}

// Scratch views of one chunk of at most W rows.
struct Scratch {
  __nv_bfloat16 *q_full, *q_nope, *o_lat, *out_c;
};
Scratch scratch(const TensorList& out, int64_t W, int64_t H) {
  NUCLEUS_CHECK(out[1].nbytes() >= static_cast<size_t>(W * H * (kernels::kMlaDecodeLatent + kernels::kMlaDecodeNope) * 2) &&
                    out[2].nbytes() >= static_cast<size_t>(W * H * (kernels::kMlaDecodeLora + kernels::kMlaDecodeVHead) * 2),
                "mla_decode scratch buffers too small for {} rows x {} heads", W, H);
  auto* a = out[1].data<__nv_bfloat16>();
  auto* b = out[2].data<__nv_bfloat16>();
  return {a, a + W * H * kernels::kMlaDecodeLatent, b, b + W * H * kernels::kMlaDecodeLora};
}

kernels::MlaDecodeRows rows_of(const OpContext& ctx, const RowSet& rs, int64_t r0, int64_t n) {
  const DeviceStepInputs& dev = *ctx.dev;
  kernels::MlaDecodeRows r;
  r.rows = rs.rows ? rs.rows + r0 : nullptr;
  r.row_offset = rs.rows ? 0 : r0;
  r.num_rows = n;
  r.token_seq = dev.token_seq;
  r.query_start = dev.query_start;
  r.context_lens = dev.context_lens;
  r.block_tables = dev.block_tables;
  r.max_blocks = ctx.inputs->max_blocks_per_seq;
  r.block_size = static_cast<int>(ctx.kv_cache->block_size);
  return r;
}

// This layer's cache rows as the kernels read them.
struct LayerCache {
  const void* rows = nullptr;  // [num_slots, 576] bf16 or e4m3, or [num_slots, 656] fp8_ds_mla bytes
  bool fp8 = false;
  float k_scale = 1.0f;
  bool ds_mla = false;
};
LayerCache layer_cache(const MlaDecodeAttentionOp& op, const OpContext& ctx) {
  const KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), "mla_decode");
  NUCLEUS_CHECK(kv.width == kernels::kMlaDecodeLatent, "mla_decode needs a latent cache of width 576 (got {})",
                kv.width);
  return {kv.layer_data(op.layer()), kv.dtype() == KvCacheDtype::kFp8E4M3, kv.layer_k_scale(op.layer()),
          kv.dtype() == KvCacheDtype::kFp8DsMla};
}

// What an attention step left for the output projection: o_lat (bf16, in
// the scratch) when num_splits is 1, else the split partials, not yet merged.
struct Attended {
  int num_splits = 1;
  int min_split_keys = kernels::kMlaDecodeMinSplitKeys;
  int key_tile = kernels::kMlaDecodeTileKeys;
  const float* part_o = nullptr;
  const float* part_lse = nullptr;
};

// The small-row kernels' view of this op (kernels::MlaDecodeSmallParams):
// kv_b_proj as stored when it is bf16 or FP8 in 128 x 128 blocks, else the
// bf16 copy.
kernels::MlaDecodeSmallParams small_params(const MlaDecodeAttentionOp& op, const kernels::MlaDecodeRows& r,
                                           const __nv_bfloat16* kv_b_copy) {
  kernels::MlaDecodeSmallParams p;
  p.r = r;
  p.num_heads = static_cast<int>(op.dims().num_heads);
  const LinearWeight& w = op.kv_b();
  if (w.fp8() && w.block_n == 128 && w.block_k == 128) {
    p.kv_b = w.weight.raw();
    p.kv_b_scale = w.scale_inv.data<float>();
  } else {
    p.kv_b = kv_b_copy;
  }
  // PDL lets the kernel stream kv_b before the kernel before it has finished:
  // not for the bf16 copy, which the first call makes just before it.
  p.pdl = skinny_pdl() && !(w.fp8() && p.kv_b_scale == nullptr);
  return p;
}

// Runs the shared steps around `attend(rows, r0, scratch, small, pdl)` (which
// fills s.o_lat from s.q_full, or leaves split partials when `small`, and may
// launch its kernel as a programmatic dependent when `pdl`) for
// every chunk of at most W rows. A chunk of at most mla_decode_small_rows()
// rows (NUCLEUS_MLA_DECODE_SMALL_GEMMS; auto: 4 or 8) runs the own absorption
// kernels: gather + absorb in one, combine + output + scatter in one; larger
// chunks run the gather kernel and cuBLASLt's batched GEMMs.
template <typename Attend>
void run_absorbed(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out,
                  Attend attend) {
  const Tensor& q = in[0];
  const int64_t T = q.dim(0), H = op.dims().num_heads, W = out[1].dim(0);
  if (T <= op.attention_in_program_rows()) return;  // decode programs run this step's attention
  const RowSet rs = row_set(op, ctx, T);
  if (rs.num_rows == 0) return;
  const __nv_bfloat16* kv_b = kv_b_bf16(op);
  const Scratch s = scratch(out, W, H);
  cudaStream_t st = stream();
  // The mla_front op (width builds) or a front program already wrote every row's absorbed query.
  const bool absorbed_in = in.size() > 1 && rs.rows == nullptr && T <= op.absorbed_input_rows();
  const LinearWeight& w = op.kv_b();
  const bool fp8_direct = w.fp8() && w.block_n == 128 && w.block_k == 128;  // the kernels read FP8 as stored
  const int64_t small_rows = std::min<int64_t>(mla_decode_small_rows(H, fp8_direct), kernels::kMlaDecodeSmallRows);
  const int64_t out_stride = out[0].row_numel();
  // A decode program merges the splits and applies W_UV (output_in_program_rows): stop after the attention kernel.
  const bool handoff = T <= op.output_in_program_rows();
  if (handoff && (rs.rows != nullptr || T > std::min<int64_t>(W, kernels::kMlaDecodeSmallRows)))
    return ctx.fail(internal_error("mla_decode (layer " + std::to_string(op.layer()) + "): a step of " +
                                   std::to_string(T) + " rows" + (rs.rows ? " with multi-token sequences" : "") +
                                   " cannot leave its splits to the decode program (scratch of " + std::to_string(W) +
                                   " rows)"));
  for (int64_t r0 = 0; r0 < rs.num_rows; r0 += W) {
    const int64_t n = std::min(W, rs.num_rows - r0);
    const kernels::MlaDecodeRows r = rows_of(ctx, rs, r0, n);
    const bool small = n <= small_rows || handoff;
    Scratch chunk = s;
    int e = 0;
    if (absorbed_in) {
      chunk.q_full = in[1].data<__nv_bfloat16>() + r0 * H * kernels::kMlaDecodeLatent;
    } else if (small) {
      kernels::MlaDecodeSmallParams p = small_params(op, r, kv_b);
      p.q = q.data<__nv_bfloat16>();
      p.q_stride = q.row_numel();
      p.q_full = s.q_full;
      NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_decode_absorb_small(p, st));
    } else {
      NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_decode_gather_q(r, q.data<__nv_bfloat16>(), q.row_numel(),
                                                             static_cast<int>(H), s.q_nope, s.q_full, st));
      e = kernels::mla_decode_gemm_absorb(kv_b, static_cast<int>(H), n, s.q_nope, s.q_full, st);
      if (e != 0)
        return ctx.fail(internal_error("mla_decode q absorption GEMM failed: cuBLAS status " + std::to_string(e) +
                                       " (rows " + std::to_string(n) + ", heads " + std::to_string(H) + ")"));
    }
    // Without the absorb kernel (absorbed_in) the attention kernel's
    // predecessor is the mla_front build, which writes this step's cache
    // rows: the attention kernel then must not run ahead of it (no PDL).
    const Attended a = attend(r, r0, chunk, small, small && !absorbed_in);
    if (ctx.failed() || handoff) return;
    if (small) {
      kernels::MlaDecodeSmallParams p = small_params(op, r, kv_b);
      p.o_lat = s.o_lat;
      p.num_splits = a.num_splits;
      p.min_split_keys = a.min_split_keys;
      p.key_tile = a.key_tile;
      p.part_o = a.part_o;
      p.part_lse = a.part_lse;
      p.out = out[0].data<__nv_bfloat16>();
      p.out_stride = out_stride;
      NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_decode_output_small(p, st));
    } else if (rs.rows) {
      e = kernels::mla_decode_gemm_output(kv_b, static_cast<int>(H), n, s.o_lat, s.out_c,
                                          H * kernels::kMlaDecodeVHead, st);
      if (e != 0) return ctx.fail(internal_error("mla_decode output GEMM failed: cuBLAS status " + std::to_string(e)));
      NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_decode_scatter_out(r, s.out_c, H * kernels::kMlaDecodeVHead,
                                                                out[0].data<__nv_bfloat16>(), out_stride, st));
    } else {
      e = kernels::mla_decode_gemm_output(kv_b, static_cast<int>(H), n, s.o_lat,
                                          out[0].data<__nv_bfloat16>() + r0 * out_stride, out_stride, st);
      if (e != 0) return ctx.fail(internal_error("mla_decode output GEMM failed: cuBLAS status " + std::to_string(e)));
    }
  }
}

// Floats of split partials (outputs and LSEs) a chunk of at most
// `max_rows` rows may use, at least 1.
int64_t partial_floats(int H, int64_t max_rows) {
  const int sms = cuda::context().num_sms;
  int64_t most = 0;
  // NUCLEUS_MLA_DECODE_CTAS_PER_SM and NUCLEUS_MLA_DECODE_WGMMA may change between calls.
  for (const int hpc : {kernels::mla_decode_heads_per_cta(H), kernels::kMlaDecodeWgmmaHeads})
    for (int64_t n = 1; n <= max_rows; ++n)
      for (int per_sm : {1, 2}) {
        const int splits = kernels::mla_decode_num_splits(n, H, hpc, sms * per_sm);
        if (splits > 1) most = std::max(most, n * splits);
      }
  return std::max<int64_t>(1, most * H * (kernels::kMlaDecodeLora + 1));
}

// The nucleus attention step for one chunk of rows: the split-KV kernel, then
// the combine kernel unless `small` (the small output kernel merges the
// splits; the attention kernel is then its PDL predecessor and the absorb
// kernel's dependent). Its split partials live in ctx.workspace.
// The launch shape of a nucleus attention call of num_rows rows: wgmma or
// not, heads a CTA, CTAs a multiprocessor, the grid's splits, the split rule
// and the key tile (read from the switches at every call).
struct LaunchShape {
  bool wgmma = false;
  int hpc = 16, ctas_per_sm = 1, num_splits = 1, min_split_keys = 0, key_tile = 32;
};
LaunchShape launch_shape(const MlaDecodeAttentionOp& op, int64_t num_rows) {
  const int H = static_cast<int>(op.dims().num_heads);
  LaunchShape l;
  // 64 heads a CTA on wgmma (64-key tiles, one CTA a multiprocessor), else the mma.sync kernels.
  l.wgmma = mla_decode_wgmma(num_rows, H, op.cache_dtype());
  l.hpc = l.wgmma ? kernels::kMlaDecodeWgmmaHeads : kernels::mla_decode_heads_per_cta(H);
  l.ctas_per_sm = l.hpc == 16 ? mla_decode_ctas_per_sm(num_rows, H) : 1;
  // The grid fills the CTAs the multiprocessors hold at once.
  l.num_splits = kernels::mla_decode_num_splits(num_rows, H, l.hpc, cuda::context().num_sms * l.ctas_per_sm);
  l.min_split_keys = static_cast<int>(mla_decode_min_split_keys(num_rows, H));
  l.key_tile = l.wgmma ? kernels::kMlaDecodeWideTileKeys : mla_decode_key_tile(num_rows, H);
  return l;
}

Attended nucleus_attend(MlaDecodeAttentionOp& op, OpContext& ctx, const LayerCache& cache,
                        const kernels::MlaDecodeRows& r, const Scratch& s, bool small, bool pdl) {
  const int H = static_cast<int>(op.dims().num_heads);
  const LaunchShape l = launch_shape(op, r.num_rows);
  const int hpc = l.hpc;
  kernels::MlaDecodeAttnParams p;
  p.r = r;
  p.num_heads = H;
  p.scale = op.dims().scale;
  p.q_full = s.q_full;
  p.cache = cache.rows;
  p.cache_fp8 = cache.fp8;
  p.cache_ds_mla = cache.ds_mla;
  p.k_scale = cache.k_scale;
  p.ctas_per_sm = l.ctas_per_sm;
  p.num_splits = l.num_splits;
  p.min_split_keys = l.min_split_keys;
  p.key_tile = l.key_tile;
  p.bulk_loads = mla_decode_bulk_loads(r.num_rows, H, op.cache_dtype());
  p.fp8_register_convert = mla_decode_fp8_register_convert(r.num_rows, op.cache_dtype());
  p.heads_per_cta = hpc;
  p.o_lat = s.o_lat;
  if (p.num_splits > 1) {
    const int64_t floats = r.num_rows * p.num_splits * H * (kernels::kMlaDecodeLora + 1);
    NUCLEUS_CHECK(static_cast<size_t>(floats) * sizeof(float) <= ctx.workspace.bytes,
                  "mla_decode split partials ({} rows x {} splits) exceed the step workspace of {} bytes", r.num_rows,
                  p.num_splits, ctx.workspace.bytes);
    p.part_o = static_cast<float*>(ctx.workspace.data);
    p.part_lse = p.part_o + r.num_rows * p.num_splits * H * kernels::kMlaDecodeLora;
  }
  p.combine = !small;
  p.pdl = pdl && skinny_pdl();
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_decode_attention(p, stream()));
  Attended a;
  if (small && p.num_splits > 1) {
    a.num_splits = p.num_splits;
    a.min_split_keys = p.min_split_keys;
    a.key_tile = p.key_tile;
    a.part_o = p.part_o;
    a.part_lse = p.part_lse;
  }
  return a;
}

}  // namespace

MlaDecodeSplitPlan mla_decode_nucleus_split_plan(const MlaDecodeAttentionOp& op, int64_t rows, void* workspace) {
  const LaunchShape l = launch_shape(op, rows);
  MlaDecodeSplitPlan plan;
  plan.num_splits = l.num_splits;
  plan.min_split_keys = l.min_split_keys;
  plan.key_tile = l.key_tile;
  if (l.num_splits > 1) {  // as nucleus_attend places them
    plan.part_o = static_cast<const float*>(workspace);
    plan.part_lse = plan.part_o + rows * l.num_splits * op.dims().num_heads * kernels::kMlaDecodeLora;
  }
  return plan;
}

Status mla_decode_nucleus_supports(const MlaDecodeAttentionOp& op) {
  // fp8_ds_mla rows: the kernel converts them itself (check_dims asks for
  // kv_lora 512 and qk_rope 64, the row's).
  if (op.cache_dtype() != KvCacheDtype::kFp8DsMla) NUCLEUS_RETURN_IF_ERROR(cuda_cache_dtype_supported(op.cache_dtype()));
  return check_dims(op);
}

size_t mla_decode_nucleus_workspace(const MlaDecodeAttentionOp& op, const StepLimits& limits) {
  return static_cast<size_t>(partial_floats(static_cast<int>(op.dims().num_heads), std::max<int64_t>(1, limits.max_tokens))) *
         sizeof(float);
}

void mla_decode_nucleus(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const LayerCache cache = layer_cache(op, ctx);
  run_absorbed(op, ctx, in, out,
               [&](const kernels::MlaDecodeRows& r, int64_t, const Scratch& s, bool small, bool pdl) {
                 return nucleus_attend(op, ctx, cache, r, s, small, pdl);
               });
}

namespace {

// The step's FlashInfer plans, shared by the decode ops of one head count and
// mode: plan() lists the rows they serve (host copies of each row's sequence
// and key count); each batch of rows (the ops process W at a time) is planned
// on the host by its first layer this step and reused by the others.
class FlashInferDecodePlan : public StepPlan {
 public:
  FlashInferDecodePlan(AttentionMode mode, int num_heads) : mode_(mode), num_heads_(num_heads) {}

  Status plan(OpContext& ctx) override {
    const StepInputs& si = *ctx.inputs;
    const int64_t T = si.num_tokens();
    const bool all = !(mode_ == AttentionMode::kAuto && ctx.dev->num_single_token_rows != T);
    seq_h_.clear();
    keys_h_.clear();
    for (int64_t s = 0; s < si.num_seqs(); ++s) {
      const int32_t nq = si.query_len(s);
      if (nq == 0 || (!all && nq != 1)) continue;
      for (int32_t j = 0; j < nq; ++j) {
        seq_h_.push_back(static_cast<int32_t>(s));
        keys_h_.push_back(si.context_lens[s] + j + 1);
      }
    }
    for (auto& b : batches_) b.planned = false;
    return ok_status();
  }

  // The plan of rows [r0, r0 + n) of this step, made on the first call.
  StatusOr<const kernels::FlashInferMlaPlan*> batch(int64_t r0, int64_t n, int max_blocks, cudaStream_t stream) {
    NUCLEUS_CHECK(r0 + n <= static_cast<int64_t>(seq_h_.size()), "flashinfer rows out of step");
    Batch* b = nullptr;
    for (auto& x : batches_)
      if (x.r0 == r0) b = &x;
    if (!b) {
      batches_.push_back({r0, 0, false, std::make_unique<kernels::FlashInferMlaPlan>()});
      b = &batches_.back();
    }
    if (!b->planned || b->n != n) {
      const cudaError_t e = b->plan->plan(seq_h_.data() + r0, keys_h_.data() + r0, n, num_heads_, max_blocks, stream);
      if (e != cudaSuccess) {
        cudaGetLastError();  // not sticky
        return internal_error(std::string("FlashInfer MLA plan of ") + std::to_string(n) +
                              " rows failed: " + cudaGetErrorString(e));
      }
      b->n = n;
      b->planned = true;
    }
    return b->plan.get();
  }

 private:
  struct Batch {
    int64_t r0 = 0, n = 0;
    bool planned = false;  // this step
    std::unique_ptr<kernels::FlashInferMlaPlan> plan;
  };
  AttentionMode mode_;
  int num_heads_;
  std::vector<int32_t> seq_h_, keys_h_;
  std::deque<Batch> batches_;  // stable addresses
};

}  // namespace

Status mla_decode_flashinfer_supports(const MlaDecodeAttentionOp& op) {
  if (op.output_in_program_rows() > 0 || op.attention_in_program_rows() > 0)
    return unsupported("decode programs merge this op's KV splits or run it (NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT, "
                       "NUCLEUS_DECODE_PROGRAM_ATTENTION): only the nucleus backend takes that");
  if (!kernels::flashinfer_mla_available())
    return unsupported("built without FlashInfer headers (NUCLEUS_FLASHINFER=OFF or tools/fetch_flashinfer.sh failed)");
  if (op.cache_dtype() != KvCacheDtype::kBF16)
    return unsupported(std::string("KV cache dtype ") + kv_cache_dtype_name(op.cache_dtype()) +
                       ": this FlashInfer kernel reads bf16 rows only (it would misread e4m3 bytes" +
                       (op.cache_dtype() == KvCacheDtype::kFp8DsMla ? " and the 656-byte fp8_ds_mla rows" : "") + ")");
  if (op.captured())
    return unsupported("plans on the host every step, which a CUDA graph replay cannot follow (the decode graph is "
                       "captured)");
  return check_dims(op);
}

size_t mla_decode_flashinfer_workspace(const MlaDecodeAttentionOp&, const StepLimits&) {
  return kernels::kFlashInferMlaFloatWorkspaceBytes;
}

std::shared_ptr<StepPlan> mla_decode_flashinfer_plan(const MlaDecodeAttentionOp& op) {
  return std::make_shared<FlashInferDecodePlan>(op.mode(), static_cast<int>(op.dims().num_heads));
}

void mla_decode_flashinfer(MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  auto* plan = dynamic_cast<FlashInferDecodePlan*>(op.step_plan());
  if (!plan)
    return ctx.fail(failed_precondition("flashinfer mla_decode without its step plan (select the backend and begin "
                                        "the step with StepResources)"));
  NUCLEUS_CHECK(ctx.workspace.bytes >= kernels::kFlashInferMlaFloatWorkspaceBytes,
                "flashinfer mla_decode: step workspace of {} bytes (needs {})", ctx.workspace.bytes,
                kernels::kFlashInferMlaFloatWorkspaceBytes);
  const LayerCache cache = layer_cache(op, ctx);
  NUCLEUS_CHECK(!cache.fp8 && !cache.ds_mla, "flashinfer mla_decode run on an FP8 cache (supports() refuses it)");
  run_absorbed(op, ctx, in, out, [&](const kernels::MlaDecodeRows& r, int64_t r0, const Scratch& s, bool, bool) {
    auto batch = plan->batch(r0, r.num_rows, r.max_blocks, stream());
    if (!batch.ok()) {
      ctx.fail(batch.status());
      return Attended{};
    }
    kernels::FlashInferMlaParams p;
    p.num_heads = static_cast<int>(op.dims().num_heads);
    p.scale = op.dims().scale;
    p.num_rows = r.num_rows;
    p.q_full = s.q_full;
    p.cache = static_cast<const __nv_bfloat16*>(cache.rows);
    p.block_size = r.block_size;
    p.block_tables = r.block_tables;
    p.o_lat = s.o_lat;
    p.float_workspace = ctx.workspace.data;
    NUCLEUS_OP_CUDA_CHECK(kernels::flashinfer_mla_decode(**batch, p, stream()));
    return Attended{};  // o_lat written
  });
}

// "cuda_naive": the plain absorbed-form kernel (kernels/mla/mla_attention_naive.cuh).
Status mla_decode_naive_supports(const MlaDecodeAttentionOp& op) {
  if (op.output_in_program_rows() > 0 || op.attention_in_program_rows() > 0)
    return unsupported("decode programs merge this op's KV splits or run it (NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT, "
                       "NUCLEUS_DECODE_PROGRAM_ATTENTION): only the nucleus backend takes that");
  if (op.cache_dtype() == KvCacheDtype::kFp8DsMla)
    return op.dims().kv_lora == kDsMlaLatent && op.dims().qk_rope == kDsMlaRope
               ? ok_status()
               : unsupported("fp8_ds_mla rows need kv_lora 512 and qk_rope 64");
  return cuda_cache_dtype_supported(op.cache_dtype());
}

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
    p.s = mla_naive_shape(op.dims());
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
    p.cache_ds_mla = kv.dtype() == KvCacheDtype::kFp8DsMla;
    p.k_scale = kv.layer_k_scale(op.layer());
    p.kv_b = weight_view(op.kv_b());
    p.q_lat = out[1].data<float>();
    p.o_lat = out[2].data<float>();
    p.out = out[0].data<__nv_bfloat16>();
    p.out_stride = out[0].row_numel();
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_absorbed_naive(p, stream()));
  }
}

}  // namespace nucleus::cuda_ops
