// Grouped-GEMM mixture-of-experts (the cuda_grouped backend of moe_experts):
//
//   out[t, :] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, k]
//
// (semantics: moe_ref.h, moe_experts_ref with accumulate = false). Four
// launches, all sizes on the device (no host sync; capturable in a CUDA graph):
//  1. align:   one CTA counts the (token, k) pairs per expert, prefix-sums the
//              counts, scatters the pairs into expert-sorted order and writes
//              the work list of m-tiles (expert, first sorted row);
//  2. up:      grouped GEMM over the m-tiles, x rows gathered through the
//              sorted order, SwiGLU in the epilogue -> h (bf16);
//  3. down:    grouped GEMM h . down_e^T -> y (bf16, one row per pair);
//  4. combine: out[t] = sum_k w[t, k] * y[pos(t, k)] in k order, f32, -> bf16.
// A one-token step skips the align launch (MoeGroupedOptions::align_free): its
// top_k ids are distinct experts, so pair k is m-tile k (one row, row k) of
// expert topk_ids[k], and UP, DOWN and the combine read the ids directly.
// Each output element is one fixed-order dot product and one fixed-order sum,
// so results are deterministic and do not depend on the other tokens (the
// order of rows inside an expert's range, which is not fixed, changes nothing).
//
// Two GEMM variants, chosen per call from the expected rows per active expert:
// decode-sized (BM = 16/32/64 rows, 4 warps; memory-bound: each active expert's
// weights are read once per m-tile) and prefill-sized (128 x 128 tiles, 8
// warps). Weights are bf16 or FP8 e4m3 with block scales (128 x 128 style),
// dequantized to bf16 in shared memory (q * scale rounded to bf16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/weight_view.cuh"
#include "kernels/moe/moe_naive.cuh"  // ExpertView

namespace nucleus::kernels {

struct MoeGroupedShape {
  int64_t hidden = 0;       // x / out width
  int64_t inter = 0;        // expert intermediate width (gate_up has 2 * inter rows)
  int64_t num_experts = 0;  // routed experts (<= 1024)
  int64_t top_k = 0;        // experts per token
  int64_t gate_up_block_k = 0;  // FP8 gate_up: its scale blocks' width along K (every expert's); 0 for bf16
                                // or not given (the one-token UP stream needs 128: MoeGroupedOptions::up_stream)
  int64_t down_block_k = 0;     // FP8 down: the same for down (W8A8 steps need 128 for both:
                                // MoeGroupedOptions::fp8_w8a8)
};

// Device scratch for up to `max_pairs` (token, k) pairs (num_tokens * top_k).
struct MoeGroupedWorkspace {
  int32_t* expert_offsets = nullptr;  // [num_experts + 1] first sorted row of each expert; last = pairs
  int32_t* sorted_pairs = nullptr;    // [max_pairs] pair index t * top_k + k of each sorted row
  int32_t* pair_pos = nullptr;        // [max_pairs] sorted row of each pair; -1 for an id out of range
  int32_t* tile_expert = nullptr;     // [max_tiles] expert of each m-tile
  int32_t* tile_row0 = nullptr;       // [max_tiles] first sorted row of each m-tile
  int32_t* num_tiles = nullptr;       // [1] m-tiles in the work list
  __nv_bfloat16* h = nullptr;         // [max_pairs, inter] silu(gate) * up, sorted rows
  __nv_bfloat16* y = nullptr;         // [max_pairs, hidden] expert outputs, sorted rows
  float* up_partial = nullptr;        // [k_splits, rows, 2 * inter] f32 UP sums of split-K steps,
                                      // k_splits * rows <= kMoeUpSplitRows
  // W8A8 steps (MoeGroupedOptions::fp8_w8a8; carved only for shapes with
  // gate_up_block_k == 128, else null): x and h quantized per 1 x 128 block
  // (launch_fp8_act_quant: e4m3 values, f32 scales row-major).
  uint8_t* x_fp8 = nullptr;           // [ceil(max_pairs / top_k), hidden]
  float* x_scale = nullptr;           // [ceil(max_pairs / top_k), hidden / 128]
  uint8_t* h_fp8 = nullptr;           // [max_pairs, inter]
  float* h_scale = nullptr;           // [max_pairs, ceil(inter / 128)]
  int64_t max_pairs = 0;
};

// Split-K of the UP GEMM (steps of few pairs, where the experts' column tiles
// alone leave SMs idle): at most this many splits, and splits * pairs rows of
// f32 partial sums in the workspace.
constexpr int kMoeUpMaxSplits = 8;
constexpr int64_t kMoeUpSplitRows = 512;

// Launch-time choices of launch_moe_grouped (tests and benches force them;
// the engine passes the knobs' values).
struct MoeGroupedOptions {
  int force_bm = 0;                  // 0 picks the m-tile rows; 16, 32, 64 or 128 force them
  bool fp8_register_dequant = true;  // FP8 weights of 16- and 32-row tiles converted in registers
                                     // (NUCLEUS_MOE_FP8_REGISTER_DEQUANT)
  int up_splits = 0;                 // UP split-K: 0 by the rule (moe_grouped_up_splits), 1 none,
                                     // 2..kMoeUpMaxSplits forced (within the workspace) (NUCLEUS_MOE_UP_SPLIT_K);
                                     // not where UP runs in the stream scheme (up_stream), which has no split
  bool pdl = false;                  // every launch a programmatic dependent of the one before (NUCLEUS_PDL):
                                     // DOWN streams its first weights while UP drains
  int deep_ring = -1;                // 16-row bf16 tiles with an 8-stage cp.async ring instead of 4, per GEMM:
                                     // -1 by the rule (moe_grouped_deep_ring), 0 never, 1 wherever it applies
                                     // (NUCLEUS_MOE_DEEP_RING)
  bool align_free = true;            // one-token steps of 16-row tiles without the align launch: pair k is
                                     // m-tile k of expert topk_ids[k], one row (NUCLEUS_MOE_ALIGN_FREE)
  bool combine_prefetch = true;      // the combine loads 8 pairs' positions and weights, then their rows,
                                     // then sums in k order; the same bits (NUCLEUS_MOE_COMBINE_PREFETCH)
  int up_stream = -1;                // the UP GEMM of align-free one-token steps with FP8 gate_up (128-wide K
                                     // blocks) in the FP8 stream scheme instead of the MMA tiles: -1 by the
                                     // rule (moe_grouped_up_stream), 0 never, 1 wherever it applies
                                     // (NUCLEUS_MOE_UP_STREAM)
  int fp8_w8a8 = 0;                  // FP8 experts (128 x 128 blocks) at steps of 128-row m-tiles: x and h
                                     // quantized per 1 x 128 block to e4m3 and the GEMMs on FP8 wgmma
                                     // (moe_grouped_w8a8): -1 by the rule, 0 never (the default here: the
                                     // W8A16 numerics), 1 wherever it applies; the engine passes
                                     // NUCLEUS_MOE_FP8_W8A8 (auto: -1)
  int wgmma = -1;                    // the UP and DOWN GEMMs of 128-row m-tiles on Hopper wgmma (128 x 256
                                     // tiles, moe_grouped_wgmma.cu) instead of mma.sync 128 x 128 tiles: -1 by
                                     // the rule (moe_grouped_wgmma), 0 never, 1 wherever it applies
                                     // (NUCLEUS_MOE_WGMMA)
};

// The residual add + RMSNorm that the combine runs on the rows it has just
// summed (the decoder's next add + norm folded into the MoE op,
// NUCLEUS_MOE_COMBINE_NORM; ops/moe_ops.h): for each token t,
//   out[t]       = bf16(sum_k topk_weights[t, k] * expert_k(x[t]))   (as without it)
//   residual[t] += out[t]                                            (f32)
//   normed[t]    = bf16(residual[t] * rsqrt(mean(residual[t]^2) + eps) * w)
// with launch_add_rmsnorm's arithmetic (kernels/rmsnorm/add_rmsnorm_row.cuh),
// so the same bits as the combine followed by that kernel, one launch
// instead of two. hidden <= 8192.
struct MoeCombineNorm {
  float* residual = nullptr;         // [num_tokens, hidden] f32, in/out; null: the plain combine
  const float* w = nullptr;          // [hidden] f32
  float eps = 1e-6f;
  __nv_bfloat16* normed = nullptr;   // [num_tokens, hidden] bf16; may be x (written after UP read it)
  float* zero_fill = nullptr;        // a prezero donor's fill (ops/prezero.h): [zero_fill_count] f32 zeroed
  int64_t zero_fill_count = 0;       //   by fill_blocks blocks beside the token blocks, or null
  int fill_blocks = 0;
};

// Bytes of device memory a workspace for `max_pairs` pairs needs, and the
// workspace carved out of `base` (256-byte aligned, at least that many bytes).
size_t moe_grouped_workspace_bytes(const MoeGroupedShape& s, int64_t max_pairs);
MoeGroupedWorkspace moe_grouped_workspace_carve(void* base, const MoeGroupedShape& s, int64_t max_pairs);

// Why these shapes and weights cannot run on the grouped kernels, or nullptr.
// gate_up / down: one expert's views (all experts must share dtype and blocks).
// Needs: hidden % 128 == 0, inter % 64 == 0, num_experts <= 1024, K dims <=
// 16384 (FP8: <= 128 scale blocks); FP8 blocks with block_n % 128 == 0 and
// block_k % 64 == 0.
const char* moe_grouped_unsupported(const MoeGroupedShape& s, const WeightView& gate_up, const WeightView& down);

// Runs the four steps for num_tokens tokens (num_tokens * top_k <= ws.max_pairs).
//   x:            [num_tokens, hidden] bf16 (row stride hidden)
//   topk_ids:     [num_tokens, top_k] i32 (ids outside [0, num_experts) contribute nothing)
//   topk_weights: [num_tokens, top_k] f32
//   experts:      device array [num_experts]; gate_up [2 * inter, hidden], down [hidden, inter]
//   gate_up_fp8 / down_fp8: whether those weights are FP8 (as the views say)
//   out:          [num_tokens, hidden] bf16, overwritten
//   norm:         with norm.residual set, the add + RMSNorm after the combine
//                 (MoeCombineNorm), in the combine's launch
//   opt:          the m-tile rows, the FP8 dequantization, the UP split-K
//                 and the align-free one-token path (MoeGroupedOptions). FP8 register dequantization: weights of
//                 16- and 32-row m-tiles are converted to bf16 in registers,
//                 exactly, with the block scale applied to the f32 sums of
//                 each k-tile; off: through a bf16 shared tile of q * scale
//                 rounded to bf16. UP split-K with S splits: each CTA sums a
//                 1/S share of the K range into the workspace's f32 partial
//                 rows and a fifth launch adds the S partials in split order
//                 and applies SiLU * up (deterministic).
// Stream-async; safe under graph capture (no allocation, no host sync).
// Returns cudaErrorInvalidValue for sizes beyond the workspace or with
// num_tokens * top_k * max(hidden, inter) >= 2^31 (kernels use 32-bit offsets),
// and for a norm with hidden > 8192 or a fill without fill blocks.
cudaError_t launch_moe_grouped(const __nv_bfloat16* x, int64_t num_tokens, const int32_t* topk_ids,
                               const float* topk_weights, const MoeGroupedShape& s, const ExpertView* experts,
                               bool gate_up_fp8, bool down_fp8, const MoeGroupedWorkspace& ws, __nv_bfloat16* out,
                               cudaStream_t stream, const MoeGroupedOptions& opt = {},
                               const MoeCombineNorm& norm = {});

// UP split-K count for a step of num_tokens tokens (1: no split): while the
// step's expert column tiles (active experts x inter / 64) times S leave SMs
// without a CTA, S doubles (at most kMoeUpMaxSplits, S * pairs <=
// kMoeUpSplitRows, each split >= 4 k-tiles of 128); only for 16-row m-tiles
// (decode steps). Measured (docs/perf.md "MoE experts at decode"): splitting
// a grid that already fills the SMs once costs 2-6% (V3 T = 1, V3 TP 8 T = 8),
// filling an idle machine gains up to 1.8x (V3 TP 8 FP8 T = 1, before the
// one-token FP8 UP ran in the stream scheme: moe_grouped_up_stream, which
// takes no split; launch_moe_grouped asks it first).
// With bf16 gate_up weights (bf16_weights) there is a second case: a grid the
// deep ring (moe_grouped_deep_ring) would run at one CTA an SM over more than
// one wave (SMs < CTAs) takes 2 splits when the halves then leave the deep
// ring and all fit at once on the 4-stage ring (three CTAs an SM: 2 x CTAs <=
// 3 x SMs). Measured (docs/perf.md "MoE decode: UP split in two where the deep
// ring needs a second wave"): V2-Lite at batch 1 with the two shared slots,
// 8 x 22 = 176 CTAs: UP 30.9 -> 24.4 us a layer.
int moe_grouped_up_splits(int64_t num_tokens, const MoeGroupedShape& s, int bm, int num_sms,
                          bool bf16_weights = false);

// Whether the UP GEMM of a one-token step runs in the FP8 stream scheme
// (kernels/gemm/skinny_fp8_stream.cuh: each warp owns 4 weight rows, every
// load instruction reads 512 contiguous bytes of one row, f32 FMAs on the
// exactly converted e4m3 values; no m-tile of 16 rows of which 15 are
// padding): where it applies, an align-free step (opt.align_free, one token,
// 16-row tiles) with FP8 gate_up in 128-wide K blocks, and opt.up_stream is
// 1, or -1 and the rule takes it. h = silu(gate) * up in bf16 as the MMA
// path, up to f32 summation order. Rule: every step where it applies
// (docs/perf.md "FP8 one-token MoE UP in the stream scheme
// (`NUCLEUS_MOE_UP_STREAM`, session 17)": the 4-layer FP8 V3's UP at batch 1
// 99.8 -> 77.1 us in the graph; V3 TP 8's routed experts 25.2 -> 24.2 us).
bool moe_grouped_up_stream(int64_t num_tokens, const MoeGroupedShape& s, int bm, bool gate_up_fp8,
                           const MoeGroupedOptions& opt);

// Whether the UP and DOWN GEMMs of a step with m-tiles of `bm` rows run on
// the wgmma kernel (kernels/moe/moe_grouped_wgmma.cu: 128 x 256 tiles, two
// warpgroups issuing wgmma m64n128k16 from 128-byte-swizzled shared memory,
// a 4-stage cp.async ring; FP8 weights converted to bf16(q * scale) in shared
// memory once a CTA, the numerics of the mma.sync kernel's shared-memory
// path) instead of the mma.sync 128 x 128 tiles. Where it applies: bm == 128
// (the prefill-sized tiles: moe_grouped_pick_bm), inter % 128 == 0 and
// hidden % 256 == 0 (DeepSeek-V2-Lite, V2, V3 and its TP shards down to
// inter 256; not the tiny models' inter 192), no UP split-K; opt.wgmma 1, or
// -1 and the rule takes it. Rule: every step where it applies (docs/perf.md
// "Prefill MoE GEMMs on wgmma (`NUCLEUS_MOE_WGMMA`, session 18)").
bool moe_grouped_wgmma(const MoeGroupedShape& s, int bm, const MoeGroupedOptions& opt);

// Whether a step with m-tiles of `bm` rows runs W8A8 (DeepSeek-V3's own FP8
// inference numerics, as the dense layers' cuBLASLt FP8 GEMMs): x quantized
// per 1 x 128 block (launch_fp8_act_quant), UP as FP8 wgmma over e4m3 x and
// e4m3 gate_up, each 128-wide k block's sums times x's and the weight's block
// scales in f32; h = bf16(silu(gate) * up) quantized the same way; DOWN the
// same over h. Where it applies: bm == 128, both weights FP8 with 128-wide K
// blocks (s.gate_up_block_k == s.down_block_k == 128), inter % 128 == 0, and
// wgmma not switched off (opt.wgmma != 0: W8A8 runs on wgmma only); opt.fp8_w8a8
// 1, or -1 and the rule takes it. Rule: every step where it applies
// (docs/perf.md "Prefill MoE GEMMs on wgmma (`NUCLEUS_MOE_WGMMA`, session
// 18)": V3's routed experts at 8192 tokens 19.3 -> 11.2 ms against W8A16 on
// wgmma). The numerics are those of DeepSeek-V3's own inference code and of
// the dense layers' cuBLASLt FP8 GEMMs (activations rounded to e4m3).
bool moe_grouped_w8a8(const MoeGroupedShape& s, int bm, bool gate_up_fp8, bool down_fp8,
                      const MoeGroupedOptions& opt);

// The m-tile rows launch_moe_grouped picks for these sizes (16, 32, 64 or 128).
int moe_grouped_pick_bm(int64_t num_tokens, const MoeGroupedShape& s);

// Whether one grouped GEMM of 16-row bf16 tiles (UP or DOWN) runs with the
// deep ring (8 stages of 64 k, 7 in flight: 112 KB of UP weights a CTA, 56 KB
// of DOWN's; one CTA an SM) instead of 4 stages (up to three CTAs an SM), for a launch of
// `ctas` CTAs (the work list's upper bound times the column tiles and splits)
// that each stream `k_tiles` k-tiles of 64. A few CTAs an SM cannot keep
// enough bytes in flight with the shallow ring; many CTAs can, and the deep
// ring's single CTA an SM then loses. Rule (docs/perf.md "MoE decode: a deeper
// cp.async ring for 16-row bf16 tiles"): ctas <= 4 x
// SMs and k_tiles >= 20.
bool moe_grouped_deep_ring(int64_t ctas, int64_t k_tiles, int num_sms);

namespace moe_grouped {

constexpr int kMaxKBlocks = 128;  // FP8 scale blocks along K held in shared memory

// Arguments of one grouped GEMM launch (UP or DOWN).
struct GemmArgs {
  const __nv_bfloat16* a = nullptr;     // UP: x [num_tokens, k]; DOWN: h [pairs, k]
  const int32_t* sorted_pairs = nullptr;  // UP: pair of each sorted row (token = pair / top_k)
  int top_k = 1;
  const ExpertView* experts = nullptr;  // [num_experts]
  const int32_t* expert_offsets = nullptr;
  const int32_t* tile_expert = nullptr;
  const int32_t* tile_row0 = nullptr;
  const int32_t* num_tiles = nullptr;
  __nv_bfloat16* c = nullptr;  // UP: h [pairs, n]; DOWN: y [pairs, n]
  int k = 0;                   // reduction width (UP: hidden; DOWN: inter)
  int n = 0;                   // output width (UP: inter; DOWN: hidden)
  int n_tiles = 0;             // UP: n / (BN / 2); DOWN: n / BN
  int num_experts = 0;
  // UP split-K (k_splits > 1): each CTA sums k-tiles [split * kt / S, (split
  // + 1) * kt / S) and writes raw f32 gate and up sums to
  // partial[split][row][2 * n] (gate j at j, up j at n + j) instead of h.
  int k_splits = 1;
  float* partial = nullptr;
  int partial_rows = 0;  // rows a split's block holds (>= the step's pairs)
  bool pdl = false;      // launched as a programmatic dependent (host side)
  bool deep_ring = false;  // 16-row bf16 tiles: 8 ring stages instead of 4 (host side; moe_grouped_deep_ring)
  // Align-free (a one-token step, MoeGroupedOptions::align_free): no work
  // list; m-tile t is pair t, of expert pair_experts[t] (the step's topk_ids;
  // a CTA of an id outside [0, num_experts) does nothing), one row, row t;
  // num_tiles, tile_expert, tile_row0, expert_offsets and sorted_pairs are
  // not read. The top-k ids of one token are distinct, so each activated
  // expert's weights are still read once.
  const int32_t* pair_experts = nullptr;
  int num_pairs = 0;
  // W8A8 (launch_grouped_wgmma_w8a8): A as e4m3 [rows, k] with f32 scales
  // [rows, k / 128] (one per 1 x 128 block); `a` is not read.
  const uint8_t* a_fp8 = nullptr;
  const float* a_scale = nullptr;
};

// Explicitly instantiated in moe_grouped_{up,down}_{bf16,fp8}.cu for
// (BM, BN) in {(16, 128), (32, 128), (64, 128), (128, 128)} (UP) and
// {(16, 64), (32, 64), (64, 128), (128, 128)} (DOWN); kRegs (FP8 weights
// dequantized in registers, moe_grouped_gemm.cuh) for FP8 at BM 16 and 32.
template <int BM, int BN, bool kFp8, bool kUp, bool kRegs>
cudaError_t launch_grouped_gemm_impl(const GemmArgs& args, int64_t max_tiles, cudaStream_t stream);

// The UP GEMM of an align-free one-token step in the FP8 stream scheme
// (moe_up_stream.cu): for each pair p < args.num_pairs of expert
// e = args.pair_experts[p] in [0, args.num_experts),
//   h[p, j] = bf16(silu(g_j) * u_j),  g_j = x . gate_e[j],  u_j = x . up_e[j]
// with x = args.a [args.k] bf16, gate_up FP8 e4m3 [2 * n, k] with
// weight_scale_inv blocks 128 wide along K (block_n a multiple of 128), h =
// args.c [num_pairs, n] bf16; pairs of an id out of range are not written.
// Needs k % 128 == 0 and n % 64 == 0 (else cudaErrorInvalidValue). Stream-
// async, capturable; a PDL dependent when args.pdl (it waits before it reads
// the ids, then lets its dependent start).
cudaError_t launch_up_stream(const GemmArgs& args, cudaStream_t stream);

// The grouped GEMM of 128-row m-tiles on wgmma (moe_grouped_wgmma.cu), UP
// (up: SwiGLU epilogue, h = args.c) or DOWN, bf16 or FP8 (fp8) weights; the
// same work list and outputs as launch_grouped_gemm_impl<128, 128, ...> up to
// f32 summation order. args.n_tiles is set here (UP: n / 128, DOWN: n / 256).
// Needs args.k % 64 == 0, UP n % 128 == 0, DOWN n % 256 == 0, no split-K and
// no align-free list (else cudaErrorInvalidValue). Stream-async, capturable;
// a PDL dependent when args.pdl (it waits before it reads the work list).
cudaError_t launch_grouped_wgmma(bool fp8, bool up, const GemmArgs& args, int64_t max_tiles, cudaStream_t stream);

// The W8A8 grouped GEMM of 128-row m-tiles (moe_grouped_wgmma.cu), UP (SwiGLU
// epilogue, h = args.c in bf16) or DOWN: A = args.a_fp8 / args.a_scale (UP:
// x rows gathered through the sorted order), weights e4m3 with block_k 128;
// acc += (sum over the block's 128 k of a_q * w_q) * a_scale * w_scale.
// args.n_tiles is set here (UP: n / 64, DOWN: n / 128). Needs args.k % 128 ==
// 0, n % 128 == 0, no split-K, no align-free list (else
// cudaErrorInvalidValue). Stream-async, capturable; a PDL dependent when
// args.pdl.
cudaError_t launch_grouped_wgmma_w8a8(bool up, const GemmArgs& args, int64_t max_tiles, cudaStream_t stream);

// Whether the wgmma kernel's tiles cover these widths (inter % 128, hidden % 256).
bool wgmma_shape_ok(int64_t hidden, int64_t inter);

// Its K slices a row group (1, 2, 4 or 8): skinny_default_slices over the
// step's pairs x 2 x inter rows of k e4m3 (the dense stream scheme's rule).
int up_stream_slices(int64_t pairs, int64_t inter, int64_t k, int num_sms);

}  // namespace moe_grouped
}  // namespace nucleus::kernels
