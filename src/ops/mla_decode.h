// The mla_decode op family: absorbed-form MLA attention over the paged latent
// cache (its CUDA backends: ops/mla_decode_cuda.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ops/kv_cache_dtype.h"
#include "ops/mla_attention.h"
#include "ops/op.h"

namespace nucleus {

// Absorbed-form (decode) attention over the paged latent cache for the rows of
// the sequences it serves (run after RopeKvCacheWriteOp, so a row sees its own
// key). Buffers: in = {q [T, num_heads * qk_head]}; out = {attn_out
// [T, num_heads * v_head] (only its rows written), q_lat, o_lat scratch
// [W, num_heads * kv_lora] f32 (backends may use them, W rows at a time)}.
class MlaDecodeAttentionOp : public OpWithBackends<MlaDecodeAttentionOp>, public MlaAttentionBase {
 public:
  using MlaAttentionBase::MlaAttentionBase;
  const char* kind() const override { return "mla_decode"; }
  std::string attrs() const override;
  // A plan serves the ops of one head count and mode.
  std::string step_plan_key() const override {
    return "heads=" + std::to_string(dims().num_heads) + " mode=" + attention_mode_name(mode());
  }
  static const std::vector<Backend<MlaDecodeAttentionOp>>& backends();

  // in[1] (when given) holds the absorbed query [T, num_heads, kv_lora +
  // qk_rope] bf16 for steps of at most this many rows; wider steps absorb q
  // themselves. Default: every step (the width builds' mla_front op); a
  // front program that absorbs (ops/front_program_op.h) serves steps of at
  // most 8 rows.
  void set_absorbed_input_rows(int64_t rows) { absorbed_input_rows_ = rows; }
  int64_t absorbed_input_rows() const { return absorbed_input_rows_; }
  // For steps of at most this many rows (a MoE program that runs the
  // attention's output, ops/moe_program_op.h: 8; default 0, never) the op
  // stops after the attention kernel: it leaves the KV splits' partials in
  // the step workspace (mla_decode_nucleus_split_plan says where), or o_lat
  // in out[2] with one split, and does not write attn_out; the program merges
  // the splits and applies W_UV. Only the nucleus backend does this; the
  // others refuse an op set so.
  void set_output_in_program_rows(int64_t rows) { output_in_program_rows_ = rows; }
  int64_t output_in_program_rows() const { return output_in_program_rows_; }
  // For steps of at most this many rows (default 0, never) the op does
  // nothing: decode programs run the attention itself (a front program's
  // kAttend stage, the MoE program's merge and W_UV). Only the nucleus
  // backend takes this (the others refuse an op set so).
  void set_attention_in_program_rows(int64_t rows) { attention_in_program_rows_ = rows; }
  int64_t attention_in_program_rows() const { return attention_in_program_rows_; }

 private:
  int64_t absorbed_input_rows_ = INT64_MAX;
  int64_t output_in_program_rows_ = 0;
  int64_t attention_in_program_rows_ = 0;
};

// The most rows a decode attention call of `num_heads` heads (kv_b_proj FP8
// or not) runs through the own absorption kernels
// (kernels::launch_mla_decode_absorb_small / _output_small) instead of
// cuBLASLt's batched GEMMs, by NUCLEUS_MLA_DECODE_SMALL_GEMMS: auto (default)
// the measured rule mla_decode_small_rows_auto, 1 every call they take (8
// rows), 0 none. Read at every call, so a benchmark can compare the settings
// in one process; a malformed value reads as auto here and is refused by
// mla_decode_env_status() at model creation.
int64_t mla_decode_small_rows(int64_t num_heads, bool fp8_kv_b);
// The auto rule (docs/perf.md "MLA decode at small batches", H200): the own
// kernels win at 1-4 rows at every measured shape, and at 8 rows with an FP8
// kv_b_proj or 16 heads; a bf16 kv_b_proj of 128 heads lost 2-4% at 8 rows.
int64_t mla_decode_small_rows_auto(int64_t num_heads, bool fp8_kv_b);
// Keys each KV split of the nucleus decode attention kernel streams at least
// (kernels::MlaDecodeAttnParams::min_split_keys) for a call of `num_rows`
// rows and `num_heads` heads, by NUCLEUS_MLA_DECODE_SPLIT_KEYS: auto
// (default) the rule mla_decode_min_split_keys_auto, or N (a multiple of 32
// from 32 to 1024). 0 means the split plan is made on the device, per row
// from its key count (kernels::kMlaDecodeSplitsAuto). Read at every call; a
// malformed value reads as auto here and is refused by
// mla_decode_env_status().
int64_t mla_decode_min_split_keys(int64_t num_rows, int64_t num_heads);
int64_t mla_decode_min_split_keys_auto(int64_t num_rows, int64_t num_heads);
// CTAs a multiprocessor holds in the nucleus decode attention kernel
// (kernels::MlaDecodeAttnParams::ctas_per_sm) for a call of `num_rows` rows
// of `num_heads` heads, by NUCLEUS_MLA_DECODE_CTAS_PER_SM: auto (default) the
// rule mla_decode_ctas_per_sm_auto, 1, or 2 (only where a CTA holds 16 heads,
// num_heads <= 16; else 1). Read at every call; a malformed value reads as
// auto here and is refused by mla_decode_env_status().
int mla_decode_ctas_per_sm(int64_t num_rows, int64_t num_heads);
int mla_decode_ctas_per_sm_auto(int64_t num_rows, int64_t num_heads);
// Keys of one tile of the nucleus decode attention kernel
// (kernels::MlaDecodeAttnParams::key_tile) for a call of `num_rows` rows of
// `num_heads` heads, by NUCLEUS_MLA_DECODE_KEY_TILE: auto (default) the rule
// mla_decode_key_tile_auto, 32 (the 32-key kernel) or 64 (the 64-key
// kernel). 64 only where a CTA holds 16 heads (num_heads <= 16) and one CTA
// runs a multiprocessor (mla_decode_ctas_per_sm 1); else 32. Read at every
// call; a malformed value reads as auto here and is refused by
// mla_decode_env_status().
int mla_decode_key_tile(int64_t num_rows, int64_t num_heads);
// The auto rule (docs/perf.md "MLA decode: 64-key tiles"): 64 at <= 16 heads.
int mla_decode_key_tile_auto(int64_t num_rows, int64_t num_heads);
// Whether the 64-key decode attention kernel loads cache rows with bulk
// asynchronous copies (kernels::MlaDecodeAttnParams::bulk_loads) for a call
// of `num_rows` rows of `num_heads` heads on a `cache` cache, by
// NUCLEUS_MLA_DECODE_BULK_LOADS: auto (default) the rule
// mla_decode_bulk_loads_auto, 0 (cp.async pieces) or 1. No effect where the
// 32-key kernel runs (mla_decode_key_tile 32). Read at every call; a
// malformed value reads as auto here and is refused by mla_decode_env_status().
bool mla_decode_bulk_loads(int64_t num_rows, int64_t num_heads, KvCacheDtype cache);
// The auto rule (docs/perf.md "MLA decode: bulk row loads"): bulk copies for
// bf16 and fp8_ds_mla rows (faster at every measured shape, up to 1.2x); for
// fp8_e4m3 rows from kMlaDecodeBulkLoadsE4m3MinRows rows (with the register
// conversion path, 1.3-3.5% faster there, 0.1-1.3% slower at 1-8 rows:
// docs/perf.md "Four score chains and q staged once, measured together"),
// the cp.async pieces below.
constexpr int64_t kMlaDecodeBulkLoadsE4m3MinRows = 32;
bool mla_decode_bulk_loads_auto(int64_t num_rows, int64_t num_heads, KvCacheDtype cache);

// Whether the 64-key decode attention kernel builds its MMA fragments from
// the raw rows of an FP8 cache (fp8_e4m3 or fp8_ds_mla) in registers
// (kernels::MlaDecodeAttnParams::fp8_register_convert: f16 MMAs, exact e4m3
// -> f16, q times a power of two; fp8_ds_mla: tile scales on the partial
// scores and on P) for a call of `num_rows` rows on `cache`:
// NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT, read at every call: auto
// (default) = mla_decode_fp8_register_convert_auto, 0 (the bf16 conversion
// tile in shared memory, the path before) or 1. FP8 caches and the 64-key
// kernel only; no effect elsewhere.
bool mla_decode_fp8_register_convert(int64_t num_rows, KvCacheDtype cache);

// The rule behind auto (docs/perf.md "MLA decode: FP8 fragments converted in
// registers"): fp8_e4m3 at every row count; fp8_ds_mla from 64 rows (measured
// 1.13-1.19x there, 0-15% slower at 1-32 rows); never for bf16.
bool mla_decode_fp8_register_convert_auto(int64_t num_rows, KvCacheDtype cache);
// Whether the nucleus decode attention runs on the Hopper wgmma kernel, 64
// heads a CTA (kernels::MlaDecodeAttnParams::heads_per_cta =
// kMlaDecodeWgmmaHeads, 64-key tiles; kernels/mla/mla_decode_wgmma.cu) for a
// call of `num_rows` rows of `num_heads` heads on `cache`, by
// NUCLEUS_MLA_DECODE_WGMMA: auto (default) the rule mla_decode_wgmma_auto, 0
// (the mma.sync kernels: 32 heads a CTA) or 1 (wherever it applies). It
// applies where num_heads is a multiple of 64, on bf16, fp8_e4m3 and
// fp8_ds_mla caches; never elsewhere. Read at every call.
bool mla_decode_wgmma(int64_t num_rows, int64_t num_heads, KvCacheDtype cache);
// Where the wgmma kernel applies (num_heads % 64 == 0; bf16 or FP8 cache), and the
// rule behind auto: every such call (H200, docs/perf.md "MLA decode on wgmma"
// and its session-21 FP8 section: faster than the mma.sync kernels at every
// measured shape from batch 2 on all three cache dtypes, 0.98-1.08x at batch 1).
bool mla_decode_wgmma_applies(int64_t num_heads, KvCacheDtype cache);
bool mla_decode_wgmma_auto(int64_t num_rows, int64_t num_heads, KvCacheDtype cache);
// OK, or invalid_argument naming a malformed NUCLEUS_MLA_DECODE_SMALL_GEMMS,
// NUCLEUS_MLA_DECODE_SPLIT_KEYS, NUCLEUS_MLA_DECODE_CTAS_PER_SM,
// NUCLEUS_MLA_DECODE_KEY_TILE, NUCLEUS_MLA_DECODE_BULK_LOADS,
// NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT or NUCLEUS_MLA_DECODE_WGMMA
// (checked at model creation).
Status mla_decode_env_status();

}  // namespace nucleus
