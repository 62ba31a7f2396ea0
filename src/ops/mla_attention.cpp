#include "ops/mla_attention.h"

#include <vector>

#include "core/check.h"

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

void check_cache_dtype(const KvCache& kv, KvCacheDtype expected, const char* who) {
  NUCLEUS_CHECK(kv.dtype() == expected, "{} was built for a {} KV cache but is given a {} one ({})", who,
                kv_cache_dtype_name(expected), kv_cache_dtype_name(kv.dtype()), dtype_name(kv.data.dtype()));
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
// table and decoded to f32 (an FP8 row times the layer's k_scale, an
// fp8_ds_mla row times its tiles' scales).
void gather_latent_rows(const StepInputs& si, const KvCache& kv, int64_t layer, int64_t s, int64_t num_keys,
                        std::vector<float>* latent) {
  const auto* cache = static_cast<const char*>(kv.layer_data(layer));
  const int64_t row_bytes = kv.row_bytes();
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

}  // namespace

void run_mla_reference(const MlaAttentionBase& op, bool decode_op, OpContext& ctx, const Tensor& q, const Tensor& o,
                       MlaReferenceFn ref) {
  const StepInputs& si = *ctx.inputs;
  const KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), decode_op ? "mla_decode" : "mla_prefill");
  std::vector<float> latent;
  for (int64_t s = 0; s < si.num_seqs(); ++s) {
    const int32_t num_q = si.query_len(s);
    if (num_q == 0 || !serves_sequence(op.mode(), decode_op, num_q)) continue;
    const int64_t q_begin = si.query_start[s], ctx_len = si.context_lens[s];
    gather_latent_rows(si, kv, op.layer(), s, ctx_len + num_q, &latent);
    ref(op.dims(), q.data<float>() + q_begin * q.row_numel(), q.row_numel(), num_q, ctx_len, latent.data(),
        op.kv_b().weight.data<float>(), o.data<float>() + q_begin * o.row_numel(), o.row_numel(), nullptr);
  }
}

Status cpu_kv_b_supported(const MlaAttentionBase& op) {
  if (op.kv_b().weight.dtype() != DType::kF32) return unsupported("kv_b_proj weight is not F32");
  return ok_status();
}

}  // namespace nucleus
