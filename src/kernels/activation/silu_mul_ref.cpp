#include "kernels/activation/silu_mul_ref.h"

#include <cmath>

namespace nucleus::kernels {

void silu_mul_ref(const float* gate_up, int64_t num_rows, int64_t width, float* out) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* g = gate_up + r * 2 * width;
    const float* u = g + width;
    float* o = out + r * width;
    for (int64_t i = 0; i < width; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

}  // namespace nucleus::kernels
