// CPU reference GEMM and FP8 block dequantization (fp32 compute).
#pragma once

#include <cstdint>

namespace nucleus::kernels {

// out[m, n] (+)= sum_k x[m, k] * w[n, k]   (y = x W^T, nn.Linear convention)
//   x:   [num_rows, k] f32, row stride x_stride (elements)
//   w:   [n, k] f32, contiguous
//   out: [num_rows, n] f32, row stride out_stride
// accumulate = false overwrites out (zero_init); true adds to what out holds
// (the split-K / prezero semantics: the output must have been zeroed).
// Each output element is one fixed-order dot product, so a row's result does
// not depend on the other rows (batch invariance).
void gemm_ref(const float* x, int64_t x_stride, const float* w, int64_t num_rows, int64_t n, int64_t k,
              float* out, int64_t out_stride, bool accumulate);

// Dot product of two f32 vectors in a fixed order (8 interleaved partial
// sums, then a pairwise combine).
float dot_ref(const float* a, const float* b, int64_t k);

// W[n, k] = q[n, k] * scale_inv[n / block_n, k / block_k]   (DeepSeek-V3 FP8
// block scaling: weight_scale_inv is multiplied, despite its name.)
//   q:         [n, k] float8 e4m3 bytes
//   scale_inv: [ceil(n / block_n), ceil(k / block_k)] f32
//   out:       [n, k] f32
void dequantize_fp8_block_ref(const uint8_t* q, const float* scale_inv, int64_t n, int64_t k, int64_t block_n,
                              int64_t block_k, float* out);

}  // namespace nucleus::kernels
