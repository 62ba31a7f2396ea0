// A decode program: the stages of a decode step laid out as per-CTA job
// queues for one persistent kernel (issue #20, the decode monokernel's
// streaming core; seed 003). Plain C++: the host plans and checks a program
// (plan_program), the CPU runs it as the reference (run_program_ref,
// mono_program_ref.h) and the CUDA kernel runs the same queues
// (mono_kernel.cuh). docs/decode_program.md has the design.
//
// A kGemv stage is a GEMV over the step's rows r < rows (rows <= width <= 8):
//   acc[r, i] = sum_k x[r, k] * w[i, k]                 (f32, x and w bf16)
// with one prologue making x:
//   kLoad        x = the bf16 rows at `x` (row stride x_stride)
//   kRmsNorm     x = bf16(rmsnorm(f32(x rows at `x`)) * norm_w)   (e.g. q_a_layernorm)
//   kAddRmsNorm  v = residual[r, :] + f32(delta[r, :])  (delta null: v = residual[r, :]);
//                x = bf16(v * rsqrt(mean(v^2) + eps) * norm_w)   (DeepSeek RMSNorm)
//                and, when residual_out is set, job 0 writes residual_out[r, :] = v
// and one epilogue writing `out` (row stride out_stride):
//   kStoreBf16   out[r, i] = bf16(acc[r, i])                      i < n
//   kStoreF32    out[r, i] = acc[r, i] (f32)                      i < n
//   kSiluMulBf16 out[r, j] = bf16(silu(g) * u), g = bf16(acc[r, j]),
//                u = bf16(acc[r, n/2 + j])                        j < n/2
// (the rounding points of the plain chain: a bf16 GEMM output, then
// kernels/activation/silu_mul). A stage is cut into jobs of `tile` output
// columns (weight rows; for kSiluMulBf16 `tile` pairs of gate/up rows); a job
// starts once every job of the stages in its wait_mask has finished.
//
// Mixture of experts: a kSelect stage (one job) routes the rows from their
// router logits (kernels/moe/moe_ref.h's rules: greedy softmax top-k, or
// noaux_tc on sigmoid scores with a bias) into a RouteTable: the distinct
// experts the rows chose, in increasing index, and each row's weight for
// each. A routed kGemv stage (route set) has `slots` slots of jobs; slot u
// computes the stage with the weights of the table's u-th expert (w +
// expert * expert_stride) on x + u * x_slot_stride into out + u *
// out_slot_stride, and does nothing when u >= the table's count. Slots lie
// one after another ([slots][rows, ...]: slot strides >= width * row
// strides) or side by side within each row ([rows][slots, ...]: slot strides
// >= k / the columns, every slot within the row stride): e.g. the MLA
// absorption, slot h = head h of q [rows, heads, 192] into [rows, heads, 576]. A kCombine
// stage sums the routed outputs with the rows' weights, in the table's order
// (increasing expert index), then adds the shared experts' output:
//   out[r, i] = bf16(sum_u weight[r][u] * partials[u][r, i] + shared[r, i])
//
// Weights are bf16, or float8 e4m3 with DeepSeek-V3's 128 x 128 block
// scales (Stage::w_type kFp8Block; W[i, c] = e4m3(w[i, c]) * scale[i / 128,
// c / 128], dequantize_fp8_block_ref's formula; the kernel converts the bytes
// exactly to bf16 in registers and scales each 128-wide k block's sum: W8A16,
// as kernels/gemm/skinny_fp8_gemm.cuh). They are read once, in chunks of
// kGroupRows weight rows by slice_k columns of k (kSliceK bf16 values or
// 2 kSliceK e4m3 bytes: the same bytes a row; job_group, slice_columns), so
// the kernel's copy warp streams a
// CTA's chunks back to back across job and stage boundaries: weights depend on
// nothing a step computes, except a routed stage's, which wait for the table.
#pragma once

#include <cstdint>

#include "kernels/mla/mla_split_plan.h"

#if defined(__CUDACC__)
#define NUCLEUS_MONO_HD __host__ __device__
#else
#define NUCLEUS_MONO_HD
#endif

namespace nucleus::kernels::mono {

constexpr int kMaxStages = 16;  // stages a program holds (wait_mask is 16 bits)
constexpr int kMaxWidth = 8;    // rows a step of the program has at most (the MMA's n)
constexpr int kMaxTile = 64;    // output columns (pairs for kSiluMulBf16) a job owns at most
constexpr int kGroupRows = 16;  // weight rows of a chunk (the MMA's m)
constexpr int kSliceK = 512;    // k columns of a chunk
constexpr int64_t kMaxK = 8192; // the widest x a stage builds in shared memory (8 rows)
// The widest x a kLoad stage reads: past kMaxK its x stays in global memory
// (x_from_global; e.g. o_proj at DeepSeek-V3's 128 heads, 16,384).
constexpr int64_t kMaxGlobalK = 32768;
constexpr int kMaxRouteSlots = 64;   // distinct experts a route table holds (8 rows x top-8)
constexpr int kMaxHeadSlots = 128;   // slots of a slotted stage without a table (heads: DeepSeek-V3's 128)
constexpr int kMaxExperts = 384;     // router width a kSelect stage takes (Kimi-K2)
constexpr int kMaxGroups = 8;        // noaux_tc expert groups a kSelect stage takes (DeepSeek-V3)
constexpr int kMaxMergeSplits = 256; // KV splits a kMerge stage merges (kernels::kMlaDecodeMaxSplits)

enum class Kind : int32_t { kGemv = 0, kSelect = 1, kCombine = 2, kRopeCache = 3, kMerge = 4, kAttend = 5 };
constexpr int kAttendHeads = 16;   // heads a kAttend job takes (a head group)
constexpr int kAttendTileKeys = 8; // keys a kAttend job scores at a time (one a compute warp)
constexpr int kAttendMaxRow = 576; // the widest latent row a kAttend stage reads (kv_lora + qk_rope)
enum class Prologue : int32_t { kLoad = 0, kAddRmsNorm = 1, kRmsNorm = 2 };
enum class Epilogue : int32_t { kStoreBf16 = 0, kSiluMulBf16 = 1, kStoreF32 = 2 };
enum class WeightType : int32_t { kBf16 = 0, kFp8Block = 1 };
constexpr int64_t kFp8Block = 128;  // the FP8 scale block, both axes
enum class Scoring : int32_t { kSoftmax = 0, kSigmoid = 1 };
enum class TopK : int32_t { kGreedy = 0, kNoauxTc = 1 };

// What a kSelect stage writes (global memory, read by the routed stages).
struct alignas(16) RouteTable {
  int32_t count = 0;                            // distinct experts chosen by the step's rows
  int32_t expert[kMaxRouteSlots] = {};          // their indices, increasing
  // Row r's routing weight for slot u (0: not chosen), for r < rows and u <
  // count; entries beyond are not written.
  float weight[kMaxWidth][kMaxRouteSlots] = {};
};

// One stage. Pointers are host pointers for the CPU reference and device
// pointers for the kernel; bf16 is stored as uint16_t.
struct Stage {
  Kind kind = Kind::kGemv;
  // kGemv: w [n, k] contiguous (row stride k), 16-byte aligned: bf16
  // (w_type kBf16; k % 16 == 0) or e4m3 bytes (kFp8Block: k % 32 == 0,
  // tile % 16 == 0, the SiLU halves n / 2 % 16 == 0, so no row group of 16
  // crosses a scale block); k <= kMaxK, or for kLoad <= kMaxGlobalK;
  // kSiluMulBf16: n even. kCombine: n = the columns.
  const void* w = nullptr;
  int64_t n = 0, k = 0;
  WeightType w_type = WeightType::kBf16;
  // kFp8Block: the scales [ceil(n / 128), ceil(k / 128)] f32 (row stride
  // fp8_scale_columns(k));
  // a slotted stage's expert e has scale_table[e] when set, else w_scale + e
  // * scale_expert_stride.
  const float* w_scale = nullptr;
  const float* const* scale_table = nullptr;
  int64_t scale_expert_stride = 0;
  Prologue prologue = Prologue::kLoad;
  // kLoad, kRmsNorm: [rows, k] bf16, row stride x_stride (% 8 == 0), 16-byte
  // aligned (kRmsNorm also takes norm_w and eps).
  const uint16_t* x = nullptr;
  int64_t x_stride = 0;
  // kAddRmsNorm: residual [rows, k] f32 and delta [rows, k] bf16 (row
  // strides k), norm_w [k] f32; residual_out [rows, k] f32 (not residual;
  // null: not written) gets residual + delta. 16-byte aligned.
  const float* residual = nullptr;
  const uint16_t* delta = nullptr;
  const float* norm_w = nullptr;
  float eps = 1e-6f;
  float* residual_out = nullptr;
  Epilogue epilogue = Epilogue::kStoreBf16;
  // kGemv: [rows, n] (kSiluMulBf16: [rows, n / 2]) bf16, or f32 for
  // kStoreF32, row stride out_stride; kCombine: [rows, n] bf16.
  void* out = nullptr;
  int64_t out_stride = 0;
  uint32_t wait_mask = 0;  // bit s: wait for every job of stage s (s < this stage's index)
  int32_t tile = 0;        // 1 ... kMaxTile (a multiple of kGroupRows wastes no MMA rows)
  // Routed kGemv and kCombine: the table, written by stage route_stage (a
  // kSelect this stage waits for). A slotted kGemv (routed, or `slots` > 1
  // with no table: slot u is expert u, e.g. the pieces of DeepSeek's shared
  // experts) has `slots` (routed: 1 ... kMaxRouteSlots; else 1 ...
  // kMaxHeadSlots) slots; expert e's weight is
  // w_table[e] (a device array of [n, k] weights) when set, else w + e *
  // expert_stride; x and out advance by x_slot_stride / out_slot_stride
  // elements a slot (expert_stride: weight elements, bytes for e4m3).
  const RouteTable* route = nullptr;
  int32_t route_stage = -1;
  int32_t slots = 1;
  int64_t expert_stride = 0, x_slot_stride = 0, out_slot_stride = 0;
  const void* const* w_table = nullptr;
  // kSelect: logits [rows, num_experts] f32 (row stride num_experts), bias
  // [num_experts] f32 or null (noaux_tc's e_score_correction_bias); the
  // table it writes is `table`.
  const float* logits = nullptr;
  const float* bias = nullptr;
  RouteTable* table = nullptr;
  int32_t num_experts = 0, top_k = 0, n_group = 1, topk_group = 1;
  Scoring scoring = Scoring::kSoftmax;
  TopK method = TopK::kGreedy;
  int32_t norm_topk_prob = 0;
  float routed_scaling_factor = 1.0f;
  // kCombine: partials f32 [slots][rows, n] (slot stride x_slot_stride, row
  // stride n); shared f32 [shared_slots][rows, n] (slot stride
  // shared_slot_stride) or null, added after the routed sum in slot order;
  // when residual_copy_to is set, the job also copies its columns of
  // residual_out ([rows, n] f32, an earlier stage's) there (a graph whose
  // residual lives in one buffer gets it back after every reader finished).
  const float* partials = nullptr;
  const float* shared = nullptr;
  int32_t shared_slots = 1;
  int64_t shared_slot_stride = 0;
  float* residual_copy_to = nullptr;
  // kRopeCache (MLA's RoPE with the latent cache write; one job a row, n =
  // kMaxWidth jobs, tile 1; rows >= the launch's rows do nothing): for row r
  // at position positions[r], the q_pe of every head of q ([rows, q_stride]
  // bf16, head h at h * (qk_nope + qk_rope)) rotated in place, and, when
  // slot_mapping[r] >= 0, cache[slot] = [bf16(rmsnorm(c_kv) * norm_w) |
  // bf16(rope(k_pe))] with [c_kv | k_pe] = x[r, :kv_lora + qk_rope] (kv_a, row
  // stride x_stride); RoPE on interleaved pairs with cos / sin of f32(pos) *
  // inv_freq[i], times attention_factor (kernels/rope/rope_ref.h); cache
  // [num_slots, kv_lora + qk_rope] bf16. With residual_copy_to set, the job
  // also copies row r of residual_out there (row stride n_residual). With
  // q_pe_out set, the rotated q_pe of head h of row r is also written to
  // q_pe_out + r * q_pe_out_stride + h * q_pe_out_head_stride (qk_rope
  // values; the absorbed query's rope part, [rows, heads, kv_lora + qk_rope]).
  uint16_t* q = nullptr;
  int64_t q_stride = 0;
  uint16_t* q_pe_out = nullptr;
  int64_t q_pe_out_stride = 0, q_pe_out_head_stride = 0;
  const int32_t* positions = nullptr;
  const int64_t* slot_mapping = nullptr;
  const float* inv_freq = nullptr;
  float attention_factor = 1.0f;
  uint16_t* cache = nullptr;
  int64_t num_slots = 0, n_residual = 0;
  int32_t num_heads = 0, qk_nope = 0, qk_rope = 0, kv_lora = 0;
  // kMerge (the split merge of the nucleus MLA decode attention,
  // kernels/mla/mla_decode.cuh; one job per row and head: n = width *
  // num_heads (the program's width), tile 1, job j = row j / num_heads, head j % num_heads; rows
  // >= the launch's rows do nothing): with `splits` > 1 the attention left
  // each split's normalised output partials [rows, splits, num_heads,
  // kv_lora] f32 and its log-sum-exp lse [rows, splits, num_heads] (log2
  // domain); row r uses the first ns splits (kernels/mla/mla_split_plan.h:
  // mla_split_count of its keys, context_lens[token_seq[r]] + r -
  // query_start[token_seq[r]] + 1, with splits, min_split_keys, the launch's
  // rows and key_tile), and
  //   out[r, h * kv_lora + c] = bf16(sum_{s < ns} w_s * partials[r, s, h, c]),
  //   w_s = 2^(lse_s - max) / sum_t 2^(lse_t - max)     (summed in split order)
  // (the attention's own merge, launch_mla_decode_output_small's). With
  // splits == 1 the attention wrote o_lat itself: out = x ([rows, num_heads *
  // kv_lora] bf16, row stride x_stride).
  const float* lse = nullptr;
  int32_t splits = 1, min_split_keys = 0, key_tile = 32;
  const int32_t* token_seq = nullptr;
  const int32_t* query_start = nullptr;
  const int32_t* context_lens = nullptr;
  // kAttend (absorbed-form MLA decode attention over the paged latent cache,
  // the nucleus decode attention's split-KV partials, which a kMerge stage
  // merges; one job per row, head group of kAttendHeads and split: n =
  // width * groups * splits (the program's width), tile 1, job j = split j % splits, group
  // (j / splits) % groups, row j / (splits * groups); rows >= the launch's
  // rows do nothing): q_full = x [rows, num_heads, kv_lora + qk_rope] bf16
  // (row stride x_stride); row r sees keys 0 ... context_lens[seq] + r -
  // query_start[seq] (seq = token_seq[r]), split as kMerge says; key k's
  // latent row is cache[(block_tables[seq * max_blocks + k / block_size] *
  // block_size + k % block_size)] ([num_slots, kv_lora + qk_rope] bf16). With
  // the scores in the log2 domain, s_k = scale * log2(e) * (q_full[r, h] .
  // row_k), m = max s_k, l = sum 2^(s_k - m) over the split's keys:
  //   part_o[r, split, h, :] = sum_k 2^(s_k - m) row_k[:kv_lora] / l     f32
  //   part_lse[r, split, h] = m + log2(l)                                 f32
  // A split the row does not use is not written (the merge reads only the
  // row's splits). 2 ... kMaxMergeSplits splits; kv_lora a multiple of 32 up
  // to 512, kv_lora + qk_rope <= kAttendMaxRow.
  float* part_o = nullptr;
  float* part_lse = nullptr;
  const int32_t* block_tables = nullptr;
  int32_t max_blocks = 0, block_size = 0;
  float scale = 0.0f;
  // Set by plan_program (callers leave it 0): bit t when stage t builds the
  // same x (the same add + RMSNorm, or kLoad of the same unslotted rows) and
  // no stage between t and this one writes what that x is made from; the
  // kernel then keeps x from a job of stage t.
  uint32_t x_reuse = 0;
};

// Job `tile` of stage `stage`.
struct Job {
  int32_t stage = 0;
  int32_t tile = 0;
};

// What one launch runs. queue_start [num_ctas + 1] and jobs index CTA c's
// queue as jobs[queue_start[c] .. queue_start[c + 1]); counters
// [num_stages + 1] int32 are zero before the first launch and zero again
// after each (the kernel's last CTA clears them).
struct Program {
  Stage stages[kMaxStages];
  int32_t num_stages = 0;
  int32_t width = 0;  // the build's rows (1, 2, 4 or 8)
  int32_t rows = 0;   // rows this launch computes (1 ... width); rows >= `rows` are pad rows, never read or written
  int32_t num_ctas = 0;
  const int32_t* queue_start = nullptr;
  const Job* jobs = nullptr;
  int32_t* counters = nullptr;
  // Launch the smallest build of the kernel that runs these stages (a build
  // without FP8 weights, or with unslotted GEMV stages only, has less code to
  // fetch; docs/decode_program.md "The kernel"). false: the full build.
  // NUCLEUS_DECODE_PROGRAM_LEAN. The results are the same bits either way.
  bool lean = true;
  // Counters: a CTA adds its jobs of a stage with one red.release.gpu after
  // the last of them (its barrier first), and a wait is the ld.acquire.gpu
  // poll then the barrier (the pattern of CUTLASS's GenericBarrier); false: a
  // __threadfence and an atomicAdd a job, and a fence after the poll.
  // NUCLEUS_DECODE_PROGRAM_RELEASE. The same bits either way.
  bool release_counters = true;
};

// Head groups of a kAttend stage.
NUCLEUS_MONO_HD inline int32_t attend_groups(const Stage& s) { return (s.num_heads + kAttendHeads - 1) / kAttendHeads; }

// Output columns of stage s (kSiluMulBf16: n / 2, its gate/up pairs).
NUCLEUS_MONO_HD inline int64_t stage_columns(const Stage& s) {
  return s.epilogue == Epilogue::kSiluMulBf16 ? s.n / 2 : s.n;
}
NUCLEUS_MONO_HD inline int32_t tiles_per_slot(const Stage& s) {
  return static_cast<int32_t>((stage_columns(s) + s.tile - 1) / s.tile);
}
NUCLEUS_MONO_HD inline bool routed(const Stage& s) { return s.kind == Kind::kGemv && s.route != nullptr; }
NUCLEUS_MONO_HD inline bool slotted(const Stage& s) { return s.kind == Kind::kGemv && (s.route != nullptr || s.slots > 1); }
NUCLEUS_MONO_HD inline int32_t stage_jobs(const Stage& s) {
  if (s.kind == Kind::kSelect) return 1;
  return (slotted(s) ? s.slots : 1) * tiles_per_slot(s);
}
NUCLEUS_MONO_HD inline bool fp8_weights(const Stage& s) { return s.w_type == WeightType::kFp8Block; }

// Which build of the kernel a launch of `p` takes (Program::lean): with the
// FP8 weight path if a stage has FP8 weights, with the other stage kinds if a
// stage is not an unslotted GEMV (routed and slotted GEMVs, select, RoPE,
// attend, merge, combine); both when !p.lean. Engine programs always have a
// RoPE or a combine stage, so lean only drops the FP8 path for bf16 weights.
struct ProgramBuild {
  bool fp8 = true;
  bool kinds = true;
};
NUCLEUS_MONO_HD inline ProgramBuild program_build(const Program& p) {
  ProgramBuild b{!p.lean, !p.lean};
  for (int s = 0; s < p.num_stages; ++s) {
    b.fp8 = b.fp8 || fp8_weights(p.stages[s]);
    b.kinds = b.kinds || p.stages[s].kind != Kind::kGemv || slotted(p.stages[s]);
  }
  return b;
}
// A kGemv stage whose x the kernel reads from global memory (L1 / L2) in the
// MMA loop instead of building it in shared memory: kLoad past kMaxK.
NUCLEUS_MONO_HD inline bool x_from_global(const Stage& s) {
  return s.kind == Kind::kGemv && s.prologue == Prologue::kLoad && s.k > kMaxK;
}
// Bytes of one weight element.
NUCLEUS_MONO_HD inline int64_t weight_element_bytes(const Stage& s) { return fp8_weights(s) ? 1 : 2; }
// Expert e's weight of a slotted stage (slot 0 of an unslotted one: w).
NUCLEUS_MONO_HD inline const void* expert_weight(const Stage& s, int64_t e) {
  return s.w_table ? s.w_table[e]
                   : static_cast<const void*>(static_cast<const uint8_t*>(s.w) +
                                              e * s.expert_stride * weight_element_bytes(s));
}
// Scale blocks of a row of k (the row stride of a kFp8Block stage's scales),
// and the scales of an [n, k] weight.
NUCLEUS_MONO_HD inline int64_t fp8_scale_columns(int64_t k) { return (k + kFp8Block - 1) / kFp8Block; }
NUCLEUS_MONO_HD inline int64_t fp8_scale_floats(int64_t n, int64_t k) {
  return (n + kFp8Block - 1) / kFp8Block * fp8_scale_columns(k);
}
// Expert e's scales (kFp8Block).
NUCLEUS_MONO_HD inline const float* expert_scale(const Stage& s, int64_t e) {
  return s.scale_table ? s.scale_table[e] : s.w_scale + e * s.scale_expert_stride;
}
// Job j's slot (slotted stages; 0 otherwise) and its columns [first, first + count).
NUCLEUS_MONO_HD inline int32_t job_slot(const Stage& s, int32_t j) { return j / tiles_per_slot(s); }
NUCLEUS_MONO_HD inline int64_t job_first_column(const Stage& s, int32_t j) {
  return int64_t{j % tiles_per_slot(s)} * s.tile;
}
NUCLEUS_MONO_HD inline int32_t job_columns(const Stage& s, int32_t j) {
  const int64_t left = stage_columns(s) - job_first_column(s, j);
  return static_cast<int32_t>(left < s.tile ? left : s.tile);
}
// Bytes of one element of a kGemv stage's out.
NUCLEUS_MONO_HD inline int64_t out_element_bytes(const Stage& s) { return s.epilogue == Epilogue::kStoreF32 ? 4 : 2; }
// Weight rows [a0, a0 + count) of job `tile` (of its expert's weight in a
// routed stage), and for kSiluMulBf16 also [b0, b0 + count) (the up rows of
// the same columns).
struct JobRows {
  int64_t a0 = 0, b0 = 0;
  int32_t count = 0;
  bool two = false;
};
NUCLEUS_MONO_HD inline JobRows job_rows(const Stage& s, int32_t tile) {
  JobRows r;
  r.a0 = job_first_column(s, tile);
  r.count = job_columns(s, tile);
  r.two = s.epilogue == Epilogue::kSiluMulBf16;
  r.b0 = r.two ? s.n / 2 + r.a0 : 0;
  return r;
}
// k columns of a slice: kSliceK bf16 values or 2 kSliceK e4m3 bytes (the
// same kSliceK * 2 bytes of a weight row either way).
NUCLEUS_MONO_HD inline int64_t slice_k(const Stage& s) { return fp8_weights(s) ? 2 * kSliceK : kSliceK; }
// k slices of a stage: slice_k columns each, the last one what is left.
NUCLEUS_MONO_HD inline int32_t stage_slices(const Stage& s) {
  return static_cast<int32_t>((s.k + slice_k(s) - 1) / slice_k(s));
}
// Row groups of a job: each range cut into groups of kGroupRows rows (the
// last group of a range may be shorter).
NUCLEUS_MONO_HD inline int32_t job_groups(const Stage& s, int32_t tile) {
  if (s.kind != Kind::kGemv) return 0;  // kSelect, kCombine, kRopeCache and kMerge stream no weights
  const JobRows jr = job_rows(s, tile);
  const int32_t one = (jr.count + kGroupRows - 1) / kGroupRows;
  return jr.two ? 2 * one : one;
}
// Row group g of job `tile`: its first weight row, its row count (1 ...
// kGroupRows) and the job's local output slot of its first row (range a:
// 0 ...; range b: kMaxTile ...).
struct GroupRows {
  int64_t first_row = 0;
  int32_t count = 0;
  int32_t slot = 0;
};
NUCLEUS_MONO_HD inline GroupRows job_group(const Stage& s, int32_t tile, int32_t g) {
  const JobRows jr = job_rows(s, tile);
  const int32_t one = (jr.count + kGroupRows - 1) / kGroupRows;
  const bool second = g >= one;
  const int32_t local = (second ? g - one : g) * kGroupRows;
  GroupRows gr;
  gr.first_row = (second ? jr.b0 : jr.a0) + local;
  gr.count = jr.count - local < kGroupRows ? jr.count - local : kGroupRows;
  gr.slot = (second ? kMaxTile : 0) + local;
  return gr;
}
// The k columns [first, first + count) of slice `slice`.
NUCLEUS_MONO_HD inline int64_t slice_first(const Stage& s, int32_t slice) { return int64_t{slice} * slice_k(s); }
NUCLEUS_MONO_HD inline int32_t slice_columns(const Stage& s, int32_t slice) {
  const int64_t left = s.k - slice_first(s, slice);
  return static_cast<int32_t>(left < slice_k(s) ? left : slice_k(s));
}

}  // namespace nucleus::kernels::mono
