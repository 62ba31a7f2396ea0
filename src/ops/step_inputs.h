// What one forward step reads besides weights: the packed tokens of every
// sequence in the step (its metadata) and the paged latent KV cache.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/kv_cache_dtype.h"

namespace nucleus {

// Metadata of one step, packed by the model runner (host side).
// Tokens of sequence s are rows [query_start[s], query_start[s+1]); they sit
// at positions context_lens[s] .. context_lens[s] + query_len - 1 and attend
// to the sequence's first context_lens[s] + query_len cached rows.
struct StepInputs {
  std::vector<int32_t> token_ids;     // [num_tokens]
  std::vector<int32_t> positions;     // [num_tokens]
  std::vector<int64_t> slot_mapping;  // [num_tokens]: block * block_size + offset; -1 writes nothing
  std::vector<int32_t> query_start;   // [num_seqs + 1], query_start[0] = 0
  std::vector<int32_t> context_lens;  // [num_seqs]: tokens of the sequence already cached before this step
  std::vector<int32_t> block_tables;  // [num_seqs, max_blocks_per_seq], row-major; unused entries -1
  int32_t max_blocks_per_seq = 0;
  std::vector<int32_t> logit_indices;  // rows whose logits the step returns, in output order
  // MTP steps only (ops/basic_ops.h MtpInputOp): [num_tokens, hidden] f32,
  // the previous model's hidden state for each row; on the host or the
  // step's device (StepExecutor moves a host one to the device for CUDA).
  Tensor mtp_hidden;

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t num_seqs() const { return static_cast<int64_t>(context_lens.size()); }
  int64_t num_logits() const { return static_cast<int64_t>(logit_indices.size()); }
  int32_t query_len(int64_t s) const { return query_start[s + 1] - query_start[s]; }
  // Every sequence contributes exactly one token (a pure decode step).
  bool is_decode() const { return num_tokens() == num_seqs(); }
};

// Device copies of a step's metadata (CUDA backends read these). Arrays as
// in StepInputs, plus token_seq [num_tokens] (the sequence of each row) and
// single_token_rows [num_single_token_rows] (rows whose sequence has exactly
// one query token: the decode rows of a mixed step).
struct DeviceStepInputs {
  const int32_t* token_ids = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* slot_mapping = nullptr;
  const int32_t* query_start = nullptr;
  const int32_t* context_lens = nullptr;
  const int32_t* block_tables = nullptr;
  const int32_t* logit_indices = nullptr;
  const int32_t* token_seq = nullptr;
  const int32_t* single_token_rows = nullptr;
  int64_t num_single_token_rows = 0;
};

// The paged latent KV cache: one row [c_kv | k_pe] (kv_lora + qk_rope wide)
// per token and layer. data: [num_layers, num_blocks, block_size, width] in
// F32, BF16 or F8_E4M3 (ops/kv_cache_dtype.h: an FP8 row holds
// e4m3(value / k_scale[l]) and is read as stored * k_scale[l]), or
// [num_layers, num_blocks, block_size, 656] U8 for fp8_ds_mla (the
// tile-scaled row of ops/kv_cache_dtype.h; `width` is still kv_lora + qk_rope).
// Row of slot s in layer l: data[l, s / block_size, s % block_size, :].
struct KvCache {
  Tensor data;
  int64_t num_layers = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t width = 0;
  // [num_layers] FP8 scales (empty: 1.0 for every layer); unused by bf16/f32 caches.
  std::vector<float> k_scale;
  // Tensor parallelism: every rank's cache, by rank (each rank keeps the whole
  // latent cache: MLA's latent is shared by all heads); `data` is rank 0's.
  // Empty at tensor-parallel size 1.
  std::vector<KvCache> ranks;

  int64_t num_slots() const { return num_blocks * block_size; }
  KvCacheDtype dtype() const {
    switch (data.dtype()) {
      case DType::kF8E4M3: return KvCacheDtype::kFp8E4M3;
      case DType::kU8: return KvCacheDtype::kFp8DsMla;
      case DType::kBF16: return KvCacheDtype::kBF16;
      default: return KvCacheDtype::kF32;
    }
  }
  // Bytes of one row (kv_cache_row_bytes: width * element size, or 656 for fp8_ds_mla).
  int64_t row_bytes() const { return kv_cache_row_bytes(dtype(), width); }
  // Layer l's k_scale (1.0 unless the cache is FP8 and has scales).
  float layer_k_scale(int64_t l) const {
    return dtype() == KvCacheDtype::kFp8E4M3 && !k_scale.empty() ? k_scale[static_cast<size_t>(l)] : 1.0f;
  }
  // Layer l's rows [num_slots, row_bytes()] as raw bytes of the storage dtype.
  void* layer_data(int64_t l) const { return static_cast<char*>(data.raw()) + l * num_slots() * row_bytes(); }
};

}  // namespace nucleus
