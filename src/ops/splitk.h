// Where decode GEMMs run split-K (kernels/gemm/splitk_gemm.cuh) instead of
// cuBLASLt, and in which reduction mode. Device-independent, so the CPU
// build and tests see the same choice.
//
// NUCLEUS_SPLITK (read once):
//   auto            the shapes splitk_max_rows() takes (measured rule;
//                   the default under NUCLEUS_ENABLE_PREZERO=1);
//   0               never (every linear as before: cuBLASLt, bf16 outputs;
//                   the default otherwise);
//   1               every bf16 decode GEMM, m <= 64.
// NUCLEUS_SPLITK_DETERMINISTIC=1: the deterministic reduction (split
// partials in a workspace, added in split order) instead of f32 atomics, so
// runs are bit-identical (tests; slower).
#pragma once

#include <cstdint>

#include "core/status.h"

namespace nucleus {

// NUCLEUS_SPLITK: 0 = off, auto = the rule below, 1 = every eligible decode
// GEMM; unset = auto when NUCLEUS_ENABLE_PREZERO=1, else off (measured on the
// H200: split-K pays off only with prezero removing its zeroing memsets).
enum class SplitKSwitch { kAuto, kOff, kOn };
SplitKSwitch splitk_switch();
// OK, or invalid_argument naming a malformed NUCLEUS_SPLITK (checked when a
// model is built, which then fails; splitk_switch() reads it as off).
Status splitk_env_status();

// Under kAuto, the measured rule (bench/splitk_bench.cpp on the H200,
// docs/perf.md "Split-K decode GEMMs and prezero"): split-K beats cuBLASLt
// (whose decode GEMMs take ~5.5-10 us whatever their size) on narrow outputs
// at few rows, and loses on wide ones, where cuBLASLt streams the weight near
// bandwidth:
//   n <= 256 (MoE gates)                           m <= 64
//   n <= 1024 and weight <= 4 MiB (V2-Lite kv_a)   m <= 32
//   n <= 2048 and weight <= 16 MiB (V2-Lite o_proj, V3 kv_a)  m <= 16
//   n <= 2048 (V3 q_a, 22 MiB)                      m <= 8
//   wider (q_b / q_proj, shared experts, V3 o_proj) never.
constexpr int64_t kSplitKSmallWeightBytes = int64_t{4} << 20;
constexpr int64_t kSplitKMediumWeightBytes = int64_t{16} << 20;

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
