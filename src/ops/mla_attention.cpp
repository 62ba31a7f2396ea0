#include "ops/mla_attention.h"

#include <cstring>
#include <vector>

#include "core/check.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/mla_decode_cuda.h"
#include "ops/rope_kv_cache_write_cuda.h"
#include "ops/mla_prefill_cuda.h"
#endif

namespace nucleus {

const char* attention_mode_name(AttentionMode m) {
  switch (m) {
    case AttentionMode::kAuto: return "auto";
    case AttentionMode::kExpanded: return "expanded";
    case AttentionMode::kAbsorbed: return "absorbed";
  }
  return "?";
}

StatusOr<AttentionMode> parse_attention_mode(const std::string& s) {
  if (s == "auto") return AttentionMode::kAuto;
  if (s == "expanded") return AttentionMode::kExpanded;
  if (s == "absorbed") return AttentionMode::kAbsorbed;
  return invalid_argument("attention mode '" + s + "' is not one of auto, expanded, absorbed");
}

std::string RopeKvCacheWriteOp::attrs() const {
  return "layer=" + std::to_string(layer_) + " heads=" + std::to_string(dims_.num_heads) +
         " rope=" + std::to_string(dims_.qk_rope) + " cache=" + kv_cache_dtype_name(cache_dtype_);
}

void check_cache_dtype(const KvCache& kv, KvCacheDtype expected, const char* who) {
  NUCLEUS_CHECK(kv.dtype() == expected, "{} was built for a {} KV cache but is given a {} one ({})", who,
                kv_cache_dtype_name(expected), kv_cache_dtype_name(kv.dtype()), dtype_name(kv.data.dtype()));
}

const std::vector<Backend<RopeKvCacheWriteOp>>& RopeKvCacheWriteOp::backends() {
  static const std::vector<Backend<RopeKvCacheWriteOp>> list = {
      {"cpu_ref", Device::kCpu,
       [](const RopeKvCacheWriteOp&) -> Status { return ok_status(); },
       [](RopeKvCacheWriteOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         const auto& d = op.dims();
         const StepInputs& si = *ctx.inputs;
         KvCache& kv = *ctx.kv_cache;
         check_cache_dtype(kv, op.cache_dtype(), "rope_kv_cache_write");
         const Tensor& q = out[0];
         if (q.raw() != in[0].raw())  // out of place: rotate a copy
           for (int64_t t = 0; t < q.dim(0); ++t)
             std::memcpy(q.data<float>() + t * q.row_numel(), in[0].data<float>() + t * in[0].row_numel(),
                         q.dim(1) * sizeof(float));
         const Tensor& kv_a = in[1];
         const int64_t q_stride = q.row_numel(), kv_stride = kv_a.row_numel();
         auto* cache = static_cast<char*>(kv.layer_data(op.layer()));
         const int64_t row_bytes = kv.width * static_cast<int64_t>(dtype_size(kv.data.dtype()));
         const float k_scale = kv.layer_k_scale(op.layer());
         std::vector<float> k_pe(d.qk_rope), latent(kv.width);
         for (int64_t t = 0; t < si.num_tokens(); ++t) {
           const int64_t pos = si.positions[t];
           for (int64_t h = 0; h < d.num_heads; ++h)
             kernels::apply_rope_interleaved_ref(op.rope(), pos, q.data<float>() + t * q_stride + h * d.qk_head() +
                                                                   d.qk_nope);
           const float* row = kv_a.data<float>() + t * kv_stride;
           std::memcpy(k_pe.data(), row + d.kv_lora, d.qk_rope * 4);
           kernels::apply_rope_interleaved_ref(op.rope(), pos, k_pe.data());
           const int64_t slot = si.slot_mapping[t];
           if (slot < 0) continue;
           NUCLEUS_CHECK(slot < kv.num_slots(), "slot {} outside the cache ({} slots)", slot, kv.num_slots());
           std::memcpy(latent.data(), row, d.kv_lora * 4);
           std::memcpy(latent.data() + d.kv_lora, k_pe.data(), d.qk_rope * 4);
           encode_kv_row(latent.data(), kv.width, kv.dtype(), k_scale, cache + slot * row_bytes);
         }
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda", Device::kCuda, cuda_ops::rope_kv_cache_write_supports, cuda_ops::rope_kv_cache_write},
#endif
  };
  return list;
}

bool serves_sequence(AttentionMode mode, bool decode_op, int32_t query_len) {
  switch (mode) {
    case AttentionMode::kAbsorbed: return decode_op;
    case AttentionMode::kExpanded: return !decode_op;
    case AttentionMode::kAuto: return decode_op == (query_len == 1);
  }
  return false;
}

namespace {

// The latent rows [0, num_keys) of sequence `s`, gathered through its block
// table and decoded to f32 (an FP8 row times the layer's k_scale).
void gather_latent_rows(const StepInputs& si, const KvCache& kv, int64_t layer, int64_t s, int64_t num_keys,
                        std::vector<float>* latent) {
  const auto* cache = static_cast<const char*>(kv.layer_data(layer));
  const int64_t row_bytes = kv.width * static_cast<int64_t>(dtype_size(kv.data.dtype()));
  const float k_scale = kv.layer_k_scale(layer);
  latent->resize(num_keys * kv.width);
  const int32_t* table = si.block_tables.data() + s * si.max_blocks_per_seq;
  for (int64_t j = 0; j < num_keys; ++j) {
    const int64_t block_idx = j / kv.block_size;
    NUCLEUS_CHECK(block_idx < si.max_blocks_per_seq && table[block_idx] >= 0,
                  "sequence {} has no block for position {}", s, j);
    const int64_t slot = static_cast<int64_t>(table[block_idx]) * kv.block_size + j % kv.block_size;
    decode_kv_row(cache + slot * row_bytes, kv.width, kv.dtype(), k_scale, latent->data() + j * kv.width);
  }
}

// Runs `fn` (absorbed or expanded reference) for every sequence the op serves.
template <typename Fn>
void run_reference(const MlaAttentionBase& op, bool decode_op, OpContext& ctx, const Tensor& q, const Tensor& o,
                   Fn fn) {
  const StepInputs& si = *ctx.inputs;
  const KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), decode_op ? "mla_decode" : "mla_prefill");
  std::vector<float> latent;
  for (int64_t s = 0; s < si.num_seqs(); ++s) {
    const int32_t num_q = si.query_len(s);
    if (num_q == 0 || !serves_sequence(op.mode(), decode_op, num_q)) continue;
    const int64_t q_begin = si.query_start[s], ctx_len = si.context_lens[s];
    gather_latent_rows(si, kv, op.layer(), s, ctx_len + num_q, &latent);
    fn(op.dims(), q.data<float>() + q_begin * q.row_numel(), q.row_numel(), num_q, ctx_len, latent.data(),
       op.kv_b().weight.data<float>(), o.data<float>() + q_begin * o.row_numel(), o.row_numel(), nullptr);
  }
}

Status cpu_kv_b_supported(const MlaAttentionBase& op) {
  if (op.kv_b().weight.dtype() != DType::kF32) return unsupported("kv_b_proj weight is not F32");
  return ok_status();
}

}  // namespace

std::string MlaDecodeAttentionOp::attrs() const {
  return "layer=" + std::to_string(layer()) + " heads=" + std::to_string(dims().num_heads) +
         " mode=" + attention_mode_name(mode()) + " cache=" + kv_cache_dtype_name(cache_dtype());
}

const std::vector<Backend<MlaDecodeAttentionOp>>& MlaDecodeAttentionOp::backends() {
  static const std::vector<Backend<MlaDecodeAttentionOp>> list = {
      {"cpu_ref", Device::kCpu, [](const MlaDecodeAttentionOp& op) { return cpu_kv_b_supported(op); },
       [](MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         run_reference(op, true, ctx, in[0], out[0], kernels::mla_attention_absorbed_ref);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      // nucleus first although FlashInfer is faster at most shapes (docs/perf.md,
      // "MLA decode attention"): FlashInfer plans on the host, so it refuses
      // a captured graph, and a graph replay (nucleus) would then differ from
      // an eager step (the graphs must be bit-identical to eager runs).
      {"nucleus", Device::kCuda, cuda_ops::mla_decode_nucleus_supports, cuda_ops::mla_decode_nucleus,
       cuda_ops::mla_decode_nucleus_workspace},
      {"flashinfer", Device::kCuda, cuda_ops::mla_decode_flashinfer_supports, cuda_ops::mla_decode_flashinfer,
       cuda_ops::mla_decode_flashinfer_workspace, nullptr, cuda_ops::mla_decode_flashinfer_plan},
      {"cuda_naive", Device::kCuda, cuda_ops::mla_decode_naive_supports, cuda_ops::mla_decode_naive},
#endif
  };
  return list;
}

std::string MlaPrefillAttentionOp::attrs() const {
  return "layer=" + std::to_string(layer()) + " heads=" + std::to_string(dims().num_heads) +
         " mode=" + attention_mode_name(mode()) + " context_chunk=" + std::to_string(context_chunk_) +
         " cache=" + kv_cache_dtype_name(cache_dtype());
}

const std::vector<Backend<MlaPrefillAttentionOp>>& MlaPrefillAttentionOp::backends() {
  static const std::vector<Backend<MlaPrefillAttentionOp>> list = {
      {"cpu_ref", Device::kCpu, [](const MlaPrefillAttentionOp& op) { return cpu_kv_b_supported(op); },
       [](MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         run_reference(op, false, ctx, in[0], out[0], kernels::mla_attention_expanded_ref);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      {"cuda_flash", Device::kCuda, cuda_ops::mla_prefill_flash_supports, cuda_ops::mla_prefill_flash,
       cuda_ops::mla_prefill_flash_workspace, nullptr, cuda_ops::mla_prefill_flash_plan},
      {"cuda_naive", Device::kCuda, cuda_ops::mla_prefill_naive_supports, cuda_ops::mla_prefill_naive},
#endif
  };
  return list;
}

}  // namespace nucleus
