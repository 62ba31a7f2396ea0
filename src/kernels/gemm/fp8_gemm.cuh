// FP8 block-scaled linear layers (DeepSeek-V3 layout) on Hopper:
//   out[m, n] (+)= sum_k x[m, k] * W[n, k],
//   W[n, k] = q[n, k] * scale_inv[n / 128, k / 128]   (q: float8 e4m3, scale_inv: f32).
// Framework-free: raw pointers, sizes, strides (in elements) and a stream; each
// launcher returns a cudaError_t. All launches are stream-async and safe under
// CUDA-graph capture (nothing is allocated; the split-K workspace is the
// caller's).
//
// Two own kernels (W8A16: bf16 activations, weights dequantized in registers,
// exact products, f32 accumulation with the block scale applied once per
// 128-wide k block):
//  - decode (m <= 64): memory-bound streaming of each weight byte exactly once
//    from DRAM into tensor-core fragments (mma.sync bf16), split-K across CTAs
//    with a deterministic last-CTA reduction;
//  - tiled (any m, n, k): 128x128x32 CTA tiles through a cp.async pipeline,
//    e4m3 weights converted to bf16 at fragment load, mma.sync bf16.
// And the activation quantizer that the cuBLASLt FP8 path (fp8_gemm_cublaslt.h)
// feeds on: per (row, 128-column group) scale = amax / 448, q = e4m3(x / scale).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"

namespace nucleus::kernels {

constexpr int kFp8Block = 128;           // weight scale block (both axes) and activation group
constexpr int64_t kFp8DecodeMaxRows = 64;  // the decode kernel's largest m

// One FP8 GEMM. Dimensions in elements; strides are row strides in elements.
struct Fp8GemmArgs {
  const __nv_bfloat16* x = nullptr;  // [m, k] bf16, row stride x_stride
  int64_t x_stride = 0;
  const uint8_t* w = nullptr;        // [n, k] e4m3 bytes, contiguous
  const float* scale_inv = nullptr;  // [ceil(n / 128), ceil(k / 128)] f32, contiguous
  void* out = nullptr;               // [m, n] bf16 or f32, row stride out_stride
  int64_t out_stride = 0;
  DType out_dtype = DType::kBF16;
  int64_t m = 0, n = 0, k = 0;
  bool accumulate = false;  // out += x W^T instead of out = x W^T
};

// Scratch of the decode kernel's split-K: `partial` holds f32 partial sums
// ([splits, m, n]); `counters` are zero and are left zero after each launch.
struct Fp8SplitWorkspace {
  float* partial = nullptr;
  int64_t partial_floats = 0;  // capacity; fewer splits are used when short
  int* counters = nullptr;     // [num_counters] ints, all zero
  int64_t num_counters = 0;
};

// The counters an Fp8SplitWorkspace needs for outputs n wide (one per
// 128-row tile of the decode kernel).
int64_t fp8_decode_split_counters(int64_t n);
// The partial floats that let every decode launch of at most `max_m` rows
// (capped at the decode kernel's 64) on an [n, k] weight use its full split
// count: [ceil(k / 128), min(max_m, 64), n].
int64_t fp8_decode_split_partial_floats(int64_t max_m, int64_t n, int64_t k);

// Whether the decode kernel takes `a`: m <= 64, k % 16 == 0 (16-byte weight
// rows), x rows 8-byte aligned (x_stride % 4 == 0, x 8-byte aligned), w
// 16-byte aligned.
bool fp8_decode_eligible(const Fp8GemmArgs& a);

// The decode kernel (requires fp8_decode_eligible). Uses `ws` for split-K;
// with an empty workspace it runs without splitting K.
cudaError_t launch_fp8_gemm_decode(const Fp8GemmArgs& a, const Fp8SplitWorkspace& ws, cudaStream_t stream);

// The tiled tensor-core kernel: any m, n, k, strides and alignment (vector
// copies when x and w rows are 16-byte aligned, element copies otherwise).
cudaError_t launch_fp8_gemm_tiled(const Fp8GemmArgs& a, cudaStream_t stream);

// The own kernels' dispatch: decode when eligible, tiled otherwise.
cudaError_t launch_fp8_gemm(const Fp8GemmArgs& a, const Fp8SplitWorkspace& ws, cudaStream_t stream);

// Dynamic per-1x128 activation quantization (DeepSeek-V3's act_quant):
//   for each row r < m and group g < ceil(k / 128), over columns c in the group:
//   s = max |x[r, c]| / 448   (IEEE division; 0 for an all-zero group)
//   xq[r, c] = e4m3_rne_satfinite(x[r, c] / s)   (0 when s == 0)
//   scales[r * scale_row_stride + g * scale_group_stride] = s
// so x[r, c] ~= xq[r, c] * s. x: [m, k] bf16 (row stride x_stride); xq: [m, k]
// e4m3 bytes (row stride xq_stride). Row-major scales: (ceil(k/128), 1);
// cuBLASLt's VEC128 layout ([ceil(k/128), m], m contiguous): (1, m).
// With m_pad > m, rows [m, m_pad) of xq and scales are written as zeros (x is
// not read there).
cudaError_t launch_fp8_act_quant(const __nv_bfloat16* x, int64_t x_stride, int64_t m, int64_t k, uint8_t* xq,
                                 int64_t xq_stride, float* scales, int64_t scale_row_stride,
                                 int64_t scale_group_stride, cudaStream_t stream, int64_t m_pad = 0);

// out[r, c] = y[r, c], or out[r, c] += y[r, c] (in f32, one rounding), for
// r < m, c < n. y: [>= m, n] f32 contiguous; out: [m, n] bf16 or f32, row
// stride out_stride. (The store of a GEMM computed at a padded height.)
cudaError_t launch_fp8_store_rows(const float* y, int64_t m, int64_t n, void* out, DType out_dtype,
                                  int64_t out_stride, bool accumulate, cudaStream_t stream);

}  // namespace nucleus::kernels
