// Which steps of the routed experts (moe_experts) run the fused decode kernel
// (kernels/moe/moe_decode.cuh, backend "cuda_decode") instead of the grouped
// GEMMs (cuda_grouped). Device-independent, so the CPU build and tests see the
// same choice.
//
// NUCLEUS_MOE_DECODE (read once):
//   auto (default)  steps of at most kMoeDecodeAutoMaxTokens tokens;
//   0 (off, false)  never: moe_experts dispatches to cuda_grouped as before;
//   N in 1..16      steps of at most N tokens (for measuring the switch point).
//
// Why 16 under auto (reasoned, to be confirmed by bench/moe_bench on the H200,
// docs/perf.md "MoE decode kernel"): up to T = 16 a step activates at most
// T * top_k experts and, with the routers' spread, about 1-2 tokens per
// activated expert (V2-Lite at T = 16: 96 pairs over ~50 experts; V3: 128 over
// ~110), so the fused kernel's f32 FMAs (about 3 instructions per weight
// element and token, 128 a cycle per SM) stay below the ~9 bf16 weight
// elements a cycle per SM that 4.58 TB/s delivers until ~12 tokens share one
// expert: it stays memory-bound, streams each activated expert's weights once,
// and saves the grouped path's align and combine launches and its bf16 h and y
// round trips. FP8 weights deliver ~18 e4m3 a cycle per SM, each converted
// once per chunk (~1 integer op an element) and then used by every token of
// the expert: still memory-bound at a few tokens per expert. The grouped path
// measured 57% of the roofline at T = 1 and 81% at T = 8 in bf16, 43-50% in
// FP8 (docs/perf.md "MoE experts"); the kernel takes at most 16 tokens.
#pragma once

#include <cstdint>

#include "core/status.h"

namespace nucleus {

constexpr int64_t kMoeDecodeAutoMaxTokens = 16;
constexpr int64_t kMoeDecodeKernelMaxTokens = 16;  // kernels::kMoeDecodeMaxTokens (CUDA-only header)

// The largest step (tokens) the fused decode kernel runs under
// NUCLEUS_MOE_DECODE: 0 (off) .. 16; a malformed value reads as 0.
int64_t moe_decode_max_tokens();

// OK, or invalid_argument naming a malformed NUCLEUS_MOE_DECODE (checked when
// a model is built, which then fails).
Status moe_decode_env_status();

}  // namespace nucleus
