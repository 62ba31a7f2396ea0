// Where decode GEMMs run split-K (kernels/gemm/splitk_gemm.cuh) instead of
// cuBLASLt, and in which reduction mode. Device-independent, so the CPU
// build and tests see the same choice.
//
// NUCLEUS_SPLITK (read once):
//   auto (default)  the shapes splitk_max_rows() takes;
//   0               never (every linear as before: cuBLASLt, bf16 outputs);
//   1               every bf16 decode GEMM, m <= 64.
// NUCLEUS_SPLITK_DETERMINISTIC=1: the deterministic reduction (split
// partials in a workspace, added in split order) instead of f32 atomics, so
// runs are bit-identical (tests; slower).
#pragma once

#include <cstdint>

#include "core/status.h"

namespace nucleus {

// NUCLEUS_SPLITK: unset or 0 = off (the default until the split-K choice is
// measured on the H200), auto = the rule below, 1 = every eligible decode GEMM.
enum class SplitKSwitch { kAuto, kOff, kOn };
SplitKSwitch splitk_switch();
// OK, or invalid_argument naming a malformed NUCLEUS_SPLITK (which then
// counts as off).
Status splitk_env_status();

// Under kAuto: split-K serves weights of at most this many bytes, where
// cuBLASLt's decode GEMMs are latency-bound (~5.5-6.4 us whatever the size,
// 10-45% of 4.58 TB/s on V2-Lite shapes, docs/perf.md); larger weights stream
// near bandwidth in cuBLASLt. A pre-measurement rule: bench/splitk_bench.cpp
// gives the per-shape answer on the H200, which replaces it.
constexpr int64_t kSplitKAutoMaxWeightBytes = int64_t{16} << 20;

// The largest row count m at which a bf16 decode GEMM with weight [n, k]
// runs split-K (0: never; at most 64). Rows above it run cuBLASLt.
int64_t splitk_max_rows(int64_t n, int64_t k);

// Whether split-K runs use the deterministic reduction: the value set by
// set_splitk_deterministic, else NUCLEUS_SPLITK_DETERMINISTIC. Read at each
// launch (a captured CUDA graph keeps the mode it was captured with).
bool splitk_deterministic();
void set_splitk_deterministic(bool on);
// Forgets set_splitk_deterministic (back to the environment's value).
void reset_splitk_deterministic();

}  // namespace nucleus
