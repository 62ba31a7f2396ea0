#include "kernels/gemm/gemm_ref.h"

#include "core/dtype.h"
#include "core/parallel.h"

namespace nucleus::kernels {

float dot_ref(const float* a, const float* b, int64_t k) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  for (int j = 0; i < k; ++i, ++j) acc[j] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

void gemm_ref(const float* x, int64_t x_stride, const float* w, int64_t num_rows, int64_t n, int64_t k,
              float* out, int64_t out_stride, bool accumulate) {
  // Parallel over output columns in chunks: every element is still one
  // dot product in a fixed order, so results do not depend on threading.
  parallel_for(n, 64, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t m = 0; m < num_rows; ++m) {
      const float* xr = x + m * x_stride;
      float* orow = out + m * out_stride;
      for (int64_t j = n_begin; j < n_end; ++j) {
        float v = dot_ref(xr, w + j * k, k);
        orow[j] = accumulate ? orow[j] + v : v;
      }
    }
  });
}

void dequantize_fp8_block_ref(const uint8_t* q, const float* scale_inv, int64_t n, int64_t k, int64_t block_n,
                              int64_t block_k, float* out) {
  int64_t k_blocks = (k + block_k - 1) / block_k;
  for (int64_t i = 0; i < n; ++i) {
    const float* srow = scale_inv + (i / block_n) * k_blocks;
    for (int64_t j = 0; j < k; ++j) out[i * k + j] = fp8e4m3_to_f32(q[i * k + j]) * srow[j / block_k];
  }
}

}  // namespace nucleus::kernels
