// Split-K GEMM for skinny (decode) shapes, bf16 operands, f32 output:
//   out[m, n] = (zero_init ? 0 : out[m, n]) + sum_k x[m, k] * W[n, k]
// with 1 <= m <= 64. Decode GEMMs read a weight once and do little math on
// it, so their time is the weight's bytes over the bandwidth the kernel
// reaches; a small weight split only over its rows fills few SMs. Splitting
// K as well puts every SM to work; the splits then add their partial sums
// into the output (f32 atomics), which must start at zero: that zeroing is
// what `zero_init` does (a memset before the kernel) and what the prezero
// pass hands to the preceding norm (ops/prezero.h).
//
// Framework-free: raw pointers, sizes, strides in elements, a stream; the
// launcher returns a cudaError_t. Stream-async and safe under CUDA-graph
// capture (nothing is allocated; the deterministic mode's workspace is the
// caller's).
//
// Kernel: a CTA owns 32 weight rows and one K range (split s of grid.y); its 4
// warps interleave 32-wide K chunks of that range, each lane streaming 16
// bytes per weight row per chunk and feeding mma.sync m16n8k16 (weights the A
// operand, tokens the B operand: 8 tokens per tile). The warps' sums are added
// in shared memory in warp order, then
//  - one split: stored (or added to out when !zero_init);
//  - kAtomic: atomicAdd into out (order across splits unspecified, so the
//    last bits vary between runs);
//  - kDeterministic: written to the workspace; the last CTA of a row tile
//    (atomic ticket) adds the splits in split order onto (zero_init ? 0 : out)
//    — bit-identical across runs, no memset needed.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

namespace nucleus::kernels {

constexpr int64_t kSplitKMaxRows = 64;   // largest m
constexpr int kSplitKRowsPerCta = 32;    // weight rows (output columns) per CTA
constexpr int kSplitKBlockK = 128;       // K granularity of a split (4 warps x 32)
constexpr int kSplitKMaxSplits = 32;

enum class SplitKMode {
  kAtomic,         // f32 atomics into out; zero_init by a memset of out first
  kDeterministic,  // partials in the workspace, reduced in split order
};

struct SplitKGemmArgs {
  const __nv_bfloat16* x = nullptr;  // [m, k] bf16, row stride x_stride; 16-byte aligned rows
  int64_t x_stride = 0;
  const __nv_bfloat16* w = nullptr;  // [n, k] bf16, contiguous, 16-byte aligned
  float* out = nullptr;              // [m, n] f32, row stride out_stride (a column block of a wider buffer is fine)
  int64_t out_stride = 0;
  int64_t m = 0, n = 0, k = 0;
  bool zero_init = true;  // false: add onto out's values
  int splits = 0;         // K splits; 0: splitk_default_splits(m, n, k, device SMs)
  SplitKMode mode = SplitKMode::kAtomic;
};

// Scratch of kDeterministic: `partial` holds [splits, m, n] f32 partial sums;
// `counters` are zero and left zero after each launch (one per 32-row tile).
// Launches sharing a workspace must be ordered (one stream).
struct SplitKWorkspace {
  float* partial = nullptr;
  int64_t partial_floats = 0;  // capacity; fewer splits are used when short
  int* counters = nullptr;
  int64_t num_counters = 0;
};

// The counters a kDeterministic workspace needs for outputs n wide: one per
// 32-row tile.
inline int64_t splitk_workspace_counters(int64_t n) { return (n + kSplitKRowsPerCta - 1) / kSplitKRowsPerCta; }
// The partial floats that let every launch of at most `max_m` rows on an
// [n, k] weight use its full split count: [min(32, ceil(k / 128)), max_m, n].
inline int64_t splitk_workspace_partial_floats(int64_t max_m, int64_t n, int64_t k) {
  const int64_t splits = std::min<int64_t>(kSplitKMaxSplits, (k + kSplitKBlockK - 1) / kSplitKBlockK);
  return splits * max_m * n;
}

// cudaSuccess when the kernel takes `a`: 1 <= m <= 64, k % 8 == 0,
// x_stride % 8 == 0, x and w 16-byte aligned, out_stride >= n, n and k below
// 2^31; cudaErrorInvalidValue otherwise.
cudaError_t splitk_check(const SplitKGemmArgs& a);

// The split count the launcher uses for splits = 0: about three CTAs per SM
// (two for m > 32) over (n / 32 row tiles) x splits, each split at least max(128, 4 * m
// rounded up to 8) deep in K (so the f32 partial sums a CTA adds, 32 x m,
// stay small next to the 32 x k_split weights it reads), at most 32 and at
// most ceil(k / 128). A heuristic: bench/splitk_bench.cpp sweeps the count
// per shape on the device.
int splitk_default_splits(int64_t m, int64_t n, int64_t k, int num_sms);

// Runs the GEMM on `stream`. kAtomic with zero_init and more than one split
// first clears out's [m, n] block (cudaMemset2DAsync). kDeterministic uses
// `ws` (fewer splits when its partial buffer is short; none with an empty
// workspace). Errors: cudaErrorInvalidValue for what splitk_check refuses;
// launch errors.
cudaError_t launch_splitk_gemm(const SplitKGemmArgs& a, const SplitKWorkspace& ws, cudaStream_t stream);

// The split count a launch of `a` with workspace `ws` uses (after the
// default, the K granularity and the workspace cap). For benchmarks and logs.
int splitk_effective_splits(const SplitKGemmArgs& a, const SplitKWorkspace& ws);

}  // namespace nucleus::kernels
