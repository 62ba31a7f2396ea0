#include "kernels/rmsnorm/rmsnorm_ref.h"

#include <cmath>

namespace nucleus::kernels {

void rmsnorm_ref(const float* x, int64_t x_stride, const float* w, int64_t num_rows, int64_t width, float eps,
                 float* out, int64_t out_stride) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* xr = x + r * x_stride;
    float* o = out + r * out_stride;
    double ss = 0.0;  // accumulate in double: the row's mean square is then exact to f32
    for (int64_t i = 0; i < width; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(width) + eps));
    for (int64_t i = 0; i < width; ++i) o[i] = xr[i] * inv * w[i];
  }
}

void add_rmsnorm_ref(float* residual, const float* delta, const float* w, int64_t num_rows, int64_t width,
                     float eps, float* out) {
  if (delta) {
    for (int64_t i = 0; i < num_rows * width; ++i) residual[i] += delta[i];
  }
  rmsnorm_ref(residual, width, w, num_rows, width, eps, out, width);
}

}  // namespace nucleus::kernels
