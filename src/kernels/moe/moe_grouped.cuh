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
  int64_t max_pairs = 0;
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
//   force_bm:     0 picks the variant; 16, 32, 64 (decode) or 128 (prefill) force one (tests, benches)
// Stream-async; safe under graph capture (no allocation, no host sync).
// Returns cudaErrorInvalidValue for sizes beyond the workspace or with
// num_tokens * top_k * max(hidden, inter) >= 2^31 (kernels use 32-bit offsets).
cudaError_t launch_moe_grouped(const __nv_bfloat16* x, int64_t num_tokens, const int32_t* topk_ids,
                               const float* topk_weights, const MoeGroupedShape& s, const ExpertView* experts,
                               bool gate_up_fp8, bool down_fp8, const MoeGroupedWorkspace& ws, __nv_bfloat16* out,
                               cudaStream_t stream, int force_bm = 0);

// The m-tile rows launch_moe_grouped picks for these sizes (16, 32, 64 or 128).
int moe_grouped_pick_bm(int64_t num_tokens, const MoeGroupedShape& s);

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
};

// Explicitly instantiated in moe_grouped_{up,down}_{bf16,fp8}.cu for
// (BM, BN) in {(16, 128), (32, 128), (64, 128), (128, 128)} (UP) and
// {(16, 64), (32, 64), (64, 128), (128, 128)} (DOWN).
template <int BM, int BN, bool kFp8, bool kUp>
cudaError_t launch_grouped_gemm_impl(const GemmArgs& args, int64_t max_tiles, cudaStream_t stream);

}  // namespace moe_grouped
}  // namespace nucleus::kernels
