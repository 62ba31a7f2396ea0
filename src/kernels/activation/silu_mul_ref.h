// CPU reference SwiGLU activation.
#pragma once

#include <cstdint>

namespace nucleus::kernels {

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i], silu(x) = x / (1 + e^-x)
//   gate_up: [num_rows, 2 * width] f32 (gate half first, as gate_proj | up_proj)
//   out:     [num_rows, width] f32
void silu_mul_ref(const float* gate_up, int64_t num_rows, int64_t width, float* out);

}  // namespace nucleus::kernels
