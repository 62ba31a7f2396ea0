// Fast absorbed-form MLA decode attention over the paged latent cache
// (semantics: mla_attention_ref.h, absorbed form; the same row rules as
// mla_attention_naive.cuh). One call runs, for n query rows:
//   1. gather:   q_nope_c[i, h, :] = q[row_i, h, :qk_nope]; q_full[i, h, kv_lora:] = q_pe
//   2. absorb:   q_full[i, h, :kv_lora] = q_nope_c[i, h] . W_UK[h]        (batched GEMM, bf16 out)
//   3. attend:   split-KV flash decoding, each CTA = one row x one KV split x
//                a group of 16 or 32 heads, every latent row read once for the
//                whole group; tensor cores (mma.sync m16n8k16) for
//                [heads x 576] x [576 x keys] and [heads x keys] x [keys x 512]
//                (32-key tiles, or 64-key tiles at 16 heads: key_tile below).
//                The cache is bf16, or FP8 e4m3 (ops/kv_cache_dtype.h): FP8
//                rows are converted exactly to bf16 in shared memory and the
//                layer's k_scale is factored out (scores scale * k_scale *
//                q . stored; o_lat = k_scale * sum_j p_j stored_j), so the
//                only roundings are the bf16 kernel's own. An fp8_ds_mla
//                row (kernels/mla/ds_mla_row.h) is converted in registers
//                to bf16(stored * its tile's scale), the rope part copied.
//   4. combine:  partial o_lat of the splits merged by log-sum-exp (when split)
//   5. output:   out[row_i, h, :] = o_lat[i, h] . W_UV[h]^T                (batched GEMM)
// Row i's query sits at position context_lens[seq] + (row - query_start[seq])
// and sees keys 0 .. that position. All launches are stream-async, allocate
// nothing and never synchronise the host: capturable in a CUDA graph.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/weight_view.cuh"
#include "kernels/mla/mla_split_plan.h"

namespace nucleus::kernels {

// Compile-time widths of the fast path (DeepSeek V2/V3, Kimi-K2).
constexpr int kMlaDecodeLora = 512;
constexpr int kMlaDecodeRope = 64;
constexpr int kMlaDecodeNope = 128;
constexpr int kMlaDecodeVHead = 128;
constexpr int kMlaDecodeLatent = kMlaDecodeLora + kMlaDecodeRope;  // 576
constexpr int kMlaDecodeMaxSplits = 256;
constexpr int kMlaDecodeTileKeys = 32;  // keys of one attention tile
// Keys of one tile of the 64-key attention kernel (MlaDecodeAttnParams::key_tile).
constexpr int kMlaDecodeWideTileKeys = 64;
// Heads a CTA of the Hopper wgmma attention kernel (MlaDecodeAttnParams::heads_per_cta).
constexpr int kMlaDecodeWgmmaHeads = 64;
// Keys a KV split streams at least unless a launch says otherwise
// (min_split_keys below; the fixed minimum before it became a parameter).
constexpr int kMlaDecodeMinSplitKeys = 128;
// min_split_keys = kMlaDecodeSplitsAuto and kMlaDecodeSplitCost: kernels/mla/mla_split_plan.h.

// Which rows a call processes and where their keys are.
struct MlaDecodeRows {
  const int32_t* rows = nullptr;  // [num_rows] query rows; null: rows row_offset + i
  int64_t row_offset = 0;
  int64_t num_rows = 0;
  const int32_t* token_seq = nullptr;     // [T] sequence of each row
  const int32_t* query_start = nullptr;   // [num_seqs + 1]
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks]; entries of visible keys >= 0
  int max_blocks = 0;
  int block_size = 0;  // any >= 1
};

// Step 1: q_nope_c [num_rows, num_heads, 128] and the q_pe part of q_full
// [num_rows, num_heads, 576] (bf16) from q [T, num_heads * 192] (row stride q_stride).
cudaError_t launch_mla_decode_gather_q(const MlaDecodeRows& r, const __nv_bfloat16* q, int64_t q_stride,
                                       int num_heads, __nv_bfloat16* q_nope_c, __nv_bfloat16* q_full,
                                       cudaStream_t stream);

// Steps 3 and 4. q_full: [num_rows, num_heads, 576] bf16. num_splits (1 ..
// kMlaDecodeMaxSplits) is the grid's split count; a row of num_keys keys
// splits them into chunks of c = max(ceil(num_keys / num_splits),
// min_split_keys) keys (or, with kMlaDecodeSplitsAuto, ceil(num_keys / s) for
// the rule's s) rounded up to the key tile (key_tile), and uses ceil(num_keys / c)
// splits (the rest of its CTAs return). With num_splits == 1
// o_lat is written directly; otherwise part_o [num_rows, num_splits,
// num_heads, 512] f32 and part_lse [num_rows, num_splits, num_heads] (log2
// domain) hold the splits and a combine kernel writes o_lat [num_rows,
// num_heads, 512] bf16. heads_per_cta: 16 or 32 (the mma.sync kernels), or
// kMlaDecodeWgmmaHeads (64) for the Hopper wgmma kernel
// (kernels/mla/mla_decode_wgmma.cu: num_heads a multiple of 64, any of the
// three row formats, key_tile 64, one CTA a multiprocessor; else
// cudaErrorInvalidValue).
struct MlaDecodeAttnParams {
  MlaDecodeRows r;
  int num_heads = 0;
  float scale = 0.0f;  // softmax scale (ModelConfig::softmax_scale)
  const __nv_bfloat16* q_full = nullptr;
  // This layer: [num_slots, 576] bf16, or e4m3 bytes when cache_fp8, or
  // [num_slots, 656] bytes when cache_ds_mla (kernels/mla/ds_mla_row.h).
  const void* cache = nullptr;
  bool cache_fp8 = false;
  bool cache_ds_mla = false;  // tile-scaled rows, read as stored * scale[tile]; not with cache_fp8
  float k_scale = 1.0f;  // cache_fp8 only: a row is read as stored * k_scale
  int num_splits = 1;
  // Keys a split streams at least: a multiple of kMlaDecodeTileKeys, >= 32,
  // or kMlaDecodeSplitsAuto (each row's splits from its keys and the call's
  // rows, on the device); else cudaErrorInvalidValue. Fewer keys a split put
  // more SMs to work on a few long rows, at the cost of more partials to merge.
  int min_split_keys = kMlaDecodeMinSplitKeys;
  int heads_per_cta = 16;
  // CTAs a multiprocessor holds: 1, or 2 (16 heads a CTA only) with a
  // shallower cp.async ring (2 bf16 tiles, 3 raw FP8 tiles instead of 4 / 8 /
  // 7): more warps to hide the per-tile latency, fewer bytes in flight a CTA.
  int ctas_per_sm = 1;
  // Keys of one attention tile: kMlaDecodeTileKeys (32; the kernel above), or
  // kMlaDecodeWideTileKeys (64; 16 heads a CTA and one CTA a multiprocessor
  // only): a kernel whose 8 warps each score 8 keys of a 64-key tile over all
  // 576 dims (Q held in registers), one softmax a tile shared through shared
  // memory (P as bf16), then P . V split by output columns as above. Fewer
  // instructions and barriers a key than the 32-key kernel, whose 8 warps
  // each score a quarter of the dims and all redo the tile's softmax. A split
  // is a multiple of the tile.
  int key_tile = kMlaDecodeTileKeys;
  // 64-key kernel only (ignored by the 32-key one): each cache row arrives by
  // one bulk asynchronous copy (cp.async.bulk, the copy engine, under an L2
  // evict-first policy; completion on a shared-memory mbarrier per ring
  // stage) instead of 16-byte cp.async pieces from every thread: fewer load
  // instructions and larger L2 requests. Same bytes in shared memory, so the
  // same results.
  bool bulk_loads = false;
  // 64-key kernel, FP8 rows only (cache_fp8 or cache_ds_mla; ignored
  // elsewhere): the MMAs read their key and value fragments straight from the
  // raw ring stage (rows padded to 608 / 672 bytes), e4m3 converted in
  // registers to f16 (exact), with q_full converted once to f16 times a power
  // of two 2^-e chosen from each head's largest |q| (its scores multiplied
  // back by 2^e, exact) and P rounded to f16; instead of the whole tile
  // converted to bf16 through a shared-memory tile (the path before).
  // cache_ds_mla: each 128-dim tile's partial scores times the key's tile
  // scale (f32), the rope dims with bf16 MMAs on the bf16 rows, and P . V on
  // P * scale / 2^E in f16, E the largest tile scale's exponent a warp has
  // seen (its o rescaled when E grows, 2^E applied at the end). Within the
  // bf16 tolerance of the path before.
  bool fp8_register_convert = false;
  float* part_o = nullptr;
  float* part_lse = nullptr;
  __nv_bfloat16* o_lat = nullptr;
  // false: with num_splits > 1 the combine kernel is not launched; the
  // caller's output kernel (launch_mla_decode_output_small) merges part_o.
  bool combine = true;
  // Launch as a programmatic dependent (PDL) of the kernel before it: the
  // first cache tiles are requested before q_full is read.
  bool pdl = false;
};
cudaError_t launch_mla_decode_attention(const MlaDecodeAttnParams& p, cudaStream_t stream);

// Host-side policy: the grid's split count for num_rows rows and
// num_heads heads on num_sms multiprocessors (fills the machine with about
// two CTA waves, one for heads_per_cta == kMlaDecodeWgmmaHeads; never more
// than kMlaDecodeMaxSplits).
int mla_decode_num_splits(int64_t num_rows, int num_heads, int heads_per_cta, int num_sms);
// Heads per CTA for num_heads (16 for <= 16 heads, else 32).
int mla_decode_heads_per_cta(int num_heads);

// Step 5 helper: out[row_i, :] = out_c[i, :] for num_rows rows of width
// `width` bf16 (used when rows are given as a list).
cudaError_t launch_mla_decode_scatter_out(const MlaDecodeRows& r, const __nv_bfloat16* out_c, int64_t width,
                                          __nv_bfloat16* out, int64_t out_stride, cudaStream_t stream);

// w_bf16[n, k] = bf16(W[n, k]) for a bf16 or FP8 block-scaled weight (once,
// when an FP8 kv_b_proj is first used).
cudaError_t launch_mla_decode_dequant_weight(const WeightView& w, __nv_bfloat16* w_bf16, cudaStream_t stream);

// Steps 2 and 5 as cuBLASLt strided-batched bf16 GEMMs (f32 accumulation),
// batch = heads. kv_b: [num_heads * 256, 512] bf16 (W_UK rows then W_UV rows
// per head). Plans are cached per shape; the first call of a shape must not be
// inside a graph capture. Return a cuBLAS status as an int (0 = success).
//   absorb: q_full[i, h, :512] = q_nope_c[i, h, :] . W_UK[h]      ([128] x [128, 512])
//   output: out[i * out_ld + h * 128 + :] = o_lat[i, h, :] . W_UV[h]^T  ([512] x [512, 128]^T)
// Steps 1+2 and 4+5 at decode row counts, as own kernels that read
// kv_b_proj directly (bf16, or FP8 e4m3 with 128 x 128 block scales: half the
// bytes of the bf16 copy the cuBLASLt GEMMs read) and take part in PDL. At
// most kMlaDecodeSmallRows rows a call (r.num_rows). Grid: 4 CTAs a head, a
// CTA streams a quarter of W_UK[h] or W_UV[h] (32 KB bf16, 16 KB FP8) once
// for all rows. f32 accumulation; q_full, o_lat and out are rounded to bf16
// as the cuBLASLt path rounds them, so with a bf16 kv_b_proj the two differ
// only in summation order (with FP8 the cuBLASLt path reads bf16(q * scale),
// one rounding more a weight). A kernel launched with pdl reads kv_b before
// it waits for its predecessor: kv_b must not be written by that kernel.
constexpr int kMlaDecodeSmallRows = 8;
struct MlaDecodeSmallParams {
  MlaDecodeRows r;  // r.num_rows in 1 .. kMlaDecodeSmallRows
  int num_heads = 0;
  // kv_b_proj [num_heads * 256, 512]: bf16, or e4m3 bytes when kv_b_scale is
  // set (kv_b_scale [num_heads * 2, 4] f32, 128 x 128 blocks).
  const void* kv_b = nullptr;
  const float* kv_b_scale = nullptr;
  // absorb: q [T, num_heads * 192] (row stride q_stride) -> q_full [num_rows, num_heads, 576].
  const __nv_bfloat16* q = nullptr;
  int64_t q_stride = 0;
  __nv_bfloat16* q_full = nullptr;
  // output: o_lat [num_rows, num_heads, 512] bf16 when num_splits == 1, else
  // the attention's part_o / part_lse (num_splits, as launched), merged here
  // exactly as the combine kernel merges them; out[row, h * 128 + d] for
  // row = the step row of call row i (out_stride elements a row).
  const __nv_bfloat16* o_lat = nullptr;
  const float* part_o = nullptr;
  const float* part_lse = nullptr;
  int num_splits = 1;
  int min_split_keys = kMlaDecodeMinSplitKeys;  // the attention launch's (MlaDecodeAttnParams)
  int key_tile = kMlaDecodeTileKeys;            // the attention launch's (MlaDecodeAttnParams)
  __nv_bfloat16* out = nullptr;
  int64_t out_stride = 0;
  bool pdl = false;  // launch as a programmatic dependent of the kernel before it
};
//   absorb: q_full[i, h, :512] = q[row_i, h, :128] . W_UK[h]; q_full[i, h, 512:] = q[row_i, h, 128:192]
cudaError_t launch_mla_decode_absorb_small(const MlaDecodeSmallParams& p, cudaStream_t stream);
//   output: out[row_i, h * 128 + d] = sum_c o_lat[i, h, c] W_UV[h][d, c]  (o_lat merged from the splits first)
cudaError_t launch_mla_decode_output_small(const MlaDecodeSmallParams& p, cudaStream_t stream);

int mla_decode_gemm_absorb(const __nv_bfloat16* kv_b, int num_heads, int64_t num_rows,
                           const __nv_bfloat16* q_nope_c, __nv_bfloat16* q_full, cudaStream_t stream);
int mla_decode_gemm_output(const __nv_bfloat16* kv_b, int num_heads, int64_t num_rows, const __nv_bfloat16* o_lat,
                           __nv_bfloat16* out, int64_t out_ld, cudaStream_t stream);

}  // namespace nucleus::kernels
