// LinearWeight: a linear layer's weight in the form a backend's kernels read.
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace nucleus {

// y = x W^T.
//   weight:    [out_features, in_features]; CPU: f32 (FP8 dequantized at
//              load); CUDA: bf16, or f8e4m3 with scale_inv.
//   scale_inv: FP8 only: [ceil(out / block_n), ceil(in / block_k)] f32;
//              W[n, k] = weight[n, k] * scale_inv[n / block_n, k / block_k].
struct LinearWeight {
  std::string name;  // checkpoint prefix, e.g. "model.layers.0.self_attn.q_a_proj"
  int64_t out_features = 0;
  int64_t in_features = 0;
  Tensor weight;
  Tensor scale_inv;
  int64_t block_n = 0;
  int64_t block_k = 0;

  bool fp8() const { return weight.defined() && weight.dtype() == DType::kF8E4M3; }
};

}  // namespace nucleus
