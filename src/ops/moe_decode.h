// Which steps of the routed experts (moe_experts) run the fused decode kernel
// (kernels/moe/moe_decode.cuh, backend "cuda_decode") instead of the grouped
// GEMMs (cuda_grouped). Device-independent, so the CPU build and tests see the
// same choice.
//
// NUCLEUS_MOE_DECODE (read once):
//   auto (default)  steps of at most kMoeDecodeAutoMaxTokens tokens: none;
//   0 (off, false)  never: moe_experts dispatches to cuda_grouped as before;
//   N in 1..16      steps of at most N tokens (for measuring the switch point).
//
// Why none under auto: measured on the H200 (bench/moe_bench --decode,
// docs/perf.md "MoE decode kernel", 2026-12-02) the fused kernel is slower
// than cuda_grouped at every T from 1 to 16 (V2-Lite bf16: 47.6 against
// 39.9 us at T = 1, 615 against 214 us at T = 16; V3 FP8: 189 against 175 us
// at T = 1), and only ties at V3 TP 8 bf16 T = 1. Its down kernel drains its
// loads at each expert boundary and runs one CTA per SM (130-240 registers a
// thread), so it reaches 30-72% of the roofline where cuda_grouped reaches
// 57-93%. It stays for measurement and further work behind NUCLEUS_MOE_DECODE=N.
#pragma once

#include <cstdint>

#include "core/status.h"

namespace nucleus {

constexpr int64_t kMoeDecodeAutoMaxTokens = 0;
constexpr int64_t kMoeDecodeKernelMaxTokens = 16;  // kernels::kMoeDecodeMaxTokens (CUDA-only header)

// The largest step (tokens) the fused decode kernel runs under
// NUCLEUS_MOE_DECODE: 0 (off) .. 16; a malformed value reads as 0.
int64_t moe_decode_max_tokens();

// OK, or invalid_argument naming a malformed NUCLEUS_MOE_DECODE (checked when
// a model is built, which then fails).
Status moe_decode_env_status();

// NUCLEUS_MOE_UP_SPLIT_K, the split-K of the grouped path's UP GEMM at
// decode steps (kernels::moe_grouped_up_splits), read at each use so that a
// benchmark can sweep it: 0 for auto (the rule; default), 1 for 0/off/false/1
// (no split), N for 2..8 (forced); -1 when malformed.
int moe_up_splits_switch();

// OK, or invalid_argument naming a malformed NUCLEUS_MOE_UP_SPLIT_K,
// NUCLEUS_MOE_DEEP_RING, NUCLEUS_MOE_ALIGN_FREE, NUCLEUS_MOE_COMBINE_PREFETCH,
// NUCLEUS_MOE_ROUTE_REGS, NUCLEUS_MOE_UP_STREAM, NUCLEUS_MOE_WGMMA or
// NUCLEUS_MOE_FP8_W8A8 (checked when a model is built).
Status moe_up_splits_env_status();

// NUCLEUS_MOE_DEEP_RING as kernels::MoeGroupedOptions::deep_ring, read at each
// use: -1 auto (the rule kernels::moe_grouped_deep_ring; default, and a
// malformed value until moe_up_splits_env_status refuses it), 0 off, 1 on.
int moe_deep_ring_switch();

// NUCLEUS_MOE_UP_STREAM as kernels::MoeGroupedOptions::up_stream, read at each
// use: -1 auto (the rule kernels::moe_grouped_up_stream; default, and a
// malformed value until moe_up_splits_env_status refuses it), 0 off, 1 on.
int moe_up_stream_switch();

// NUCLEUS_MOE_WGMMA as kernels::MoeGroupedOptions::wgmma, read at each use:
// -1 auto (the rule kernels::moe_grouped_wgmma; default, and a malformed value
// until moe_up_splits_env_status refuses it), 0 off, 1 on.
int moe_wgmma_switch();

// NUCLEUS_MOE_FP8_W8A8 as kernels::MoeGroupedOptions::fp8_w8a8, read at each
// use: -1 auto (the rule kernels::moe_grouped_w8a8; default, and a malformed
// value until moe_up_splits_env_status refuses it), 0 off, 1 on.
int moe_fp8_w8a8_switch();

// NUCLEUS_MOE_ALIGN_FREE as kernels::MoeGroupedOptions::align_free, read at
// each use: true for auto (default; and a malformed value until
// moe_up_splits_env_status refuses it) and 1, false for 0.
bool moe_align_free_switch();

// NUCLEUS_MOE_COMBINE_PREFETCH as kernels::MoeGroupedOptions::combine_prefetch,
// read at each use: true for auto (default; and a malformed value until
// moe_up_splits_env_status refuses it) and 1, false for 0.
bool moe_combine_prefetch_switch();

// NUCLEUS_MOE_ROUTE_REGS, read at each routing call: true for auto (default;
// and a malformed value until moe_up_splits_env_status refuses it) and 1 (the
// register path of kernels::launch_moe_route where it serves the params),
// false for 0 (the shared-memory kernel).
bool moe_route_regs_switch();

}  // namespace nucleus
