// Where bf16 decode GEMMs run the skinny kernel (kernels/gemm/skinny_gemm.cuh)
// instead of cuBLASLt. Device-independent, so the CPU build and tests see the
// same choice.
//
// NUCLEUS_SKINNY (read once):
//   auto (default)  the shapes and row counts skinny_max_rows() takes (the
//                   measured rule below);
//   0               never (every bf16 decode GEMM on cuBLASLt, as before);
//   1               every bf16 decode GEMM at m <= 8.
// NUCLEUS_PDL=0|1 (default 1): skinny GEMMs (bf16 and FP8) are launched as programmatic
// dependents (kernels/common/pdl.cuh) of the kernel before them, so they start
// streaming their weights while it finishes; 0 launches them normally. The
// MoE decode kernels (ops/moe_decode_cuda.cpp) follow the same switch.
#pragma once

#include <cstdint>

#include "core/knobs.h"
#include "core/status.h"

namespace nucleus {

using SkinnySwitch = AutoSwitch;  // core/knobs.h
SkinnySwitch skinny_switch();
// OK, or invalid_argument naming a malformed NUCLEUS_SKINNY, NUCLEUS_SKINNY_FP8
// or NUCLEUS_PDL (checked when a model is built, which then fails;
// skinny_switch() and skinny_fp8_switch() read a malformed value as off).
Status skinny_env_status();

// Whether skinny GEMMs (and the MoE and MLA decode kernels) are launched
// with PDL (NUCLEUS_PDL 1 or gemms, read once).
bool skinny_pdl();
// Whether the RMSNorm, add+RMSNorm, RoPE + cache write and MoE routing
// kernels are launched with PDL too (NUCLEUS_PDL 1, the default; gemms keeps
// them plain launches, the setting before they took part).
bool small_ops_pdl();
// NUCLEUS_SKINNY_FP8_PIPELINE: whether the FP8 skinny kernel runs pipelined
// (kernels::SkinnyFp8GemmArgs::pipelined): auto (default) where its grid
// fits one wave (kernels::skinny_fp8_pipelined_fits), 1 always, 0 never.
// Read once; a malformed value reads as off (refused by skinny_env_status).
SkinnySwitch skinny_fp8_pipeline_switch();
// NUCLEUS_SKINNY_FP8_STREAM: whether the FP8 decode GEMMs the skinny kernel
// takes run its stream scheme (kernels::SkinnyFp8GemmArgs::stream: the bf16
// skinny kernel's 4-row warps and 512-contiguous-byte loads, f32 FMAs):
// auto (default) as skinny_fp8_stream() says, 1 at every m <= 2, 0 never
// (the weights above kSkinnyFp8MediumWeightBytes then go back to cuBLASLt's
// FP8 GEMM, as before). Read once; a malformed value reads as off (refused by
// skinny_env_status).
SkinnySwitch skinny_fp8_stream_switch();

// The largest row count m (0..8) at which a bf16 decode GEMM with weight
// [n, k] runs the skinny kernel; rows above it run cuBLASLt. Under kAuto the
// rule measured by bench/skinny_gemm_bench.cpp on the H200 (docs/perf.md
// "Skinny decode GEMMs"; cuBLASLt pays ~5.5-6.5 us a GEMM whatever its size,
// the skinny kernel's f32 FMAs lose to it from m = 4 on wide outputs):
//   n <= 1024               m <= 8 (k <= 2048), else m <= 4
//   n <= 2048               m <= 4 (k <= 4096), else m <= 2
//   n <= 4096               m <= 2
//   weight >= 256 MiB       m <= 2 (lm_head)
//   n <= 8192, <= 32 MiB    m <= 1
//   otherwise               never.
constexpr int64_t kSkinnyLargeWeightBytes = int64_t{256} << 20;
constexpr int64_t kSkinnyMediumWeightBytes = int64_t{32} << 20;
int64_t skinny_max_rows(int64_t n, int64_t k);

// The FP8 skinny GEMM (kernels/gemm/skinny_fp8_gemm.cuh, backend
// cuda_skinny_fp8) for decode GEMMs of FP8 block-scaled weights.
// NUCLEUS_SKINNY_FP8 (read once; a malformed value is refused by
// skinny_env_status):
//   auto (default)  the row counts skinny_fp8_max_rows() takes;
//   0               never (the FP8 decode GEMMs on cublaslt_fp8 / cuda_fp8, as before);
//   1               every FP8 decode GEMM at m <= 16 whose k is a multiple of 128.
SkinnySwitch skinny_fp8_switch();

// The largest row count m (0..16) at which an FP8 decode GEMM with weight
// [n, k] (128x128 block scales) runs the FP8 skinny kernel; rows above it run
// the FP8 linear's other paths (ops/linear_cuda.h, Fp8Path::kAuto). 0 when k
// is not a positive multiple of 128 (the kernel needs whole scale blocks).
// Under kAuto, by the weight's bytes (n * k), from skinny_fp8_gemm_bench on
// the H200 (docs/perf.md "Skinny FP8 decode GEMMs", 2026-12-02), against the
// FP8 path it replaces at each m: up to 16 MB (V3 q_a, kv_a) it wins at every
// m <= 16 (1.5-3.6x); up to 48 MB (V3 q_b, 37.8 MB) it wins at m <= 8
// (1.05-1.3x) and loses at 16 (0.66x); above (V3 o_proj, 117 MB) the W8A16
// kernel loses at every m (0.57-0.78x: cuBLASLt streams large weights at
// 60-65%); the stream scheme beats both at m = 1 (68-75%, docs/perf.md "FP8
// decode GEMMs: the bf16 skinny kernel's load scheme"; 75-86% since its
// two-byte conversion, "FP8 stream GEMMs: e4m3 converted two bytes at a
// time") and loses at m = 2, so
// m <= 1 there (skinny_fp8_stream), or 0 with NUCLEUS_SKINNY_FP8_STREAM=0. Shapes between the measured ones
// follow their byte class.
constexpr int64_t kSkinnyFp8MaxRows = 16;  // kernels::kSkinnyFp8MaxRows (the kernel header is CUDA-only)
constexpr int64_t kSkinnyFp8SmallWeightBytes = int64_t{16} << 20;   // every m <= 16
constexpr int64_t kSkinnyFp8MediumWeightBytes = int64_t{48} << 20;  // m <= 8
// Above kSkinnyFp8MediumWeightBytes (V3's o_proj, dense MLP): the stream
// scheme at m <= kSkinnyFp8StreamRows unless NUCLEUS_SKINNY_FP8_STREAM=0 (then 0).
constexpr int64_t kSkinnyFp8StreamRows = 1;
int64_t skinny_fp8_max_rows(int64_t n, int64_t k);
// Whether an m-row FP8 decode GEMM on an [n, k] weight that the skinny kernel
// takes runs its stream scheme: NUCLEUS_SKINNY_FP8_STREAM auto: m = 1 on
// weights of at least kSkinnyFp8StreamMinBytes (measured on every V3 and
// Kimi-K2 decode linear at TP 1 and 8: 0.99-1.26x the default scheme, 1.08-
// 1.27x cuBLASLt's FP8 GEMM on the weights above 48 MB; 0.92x on the 1.8 MB
// TP-8 shared down_proj, the one smaller weight; at m = 2 it loses, 0.8x on
// the large ones); 1: every m <= 2 (kernels::kSkinnyFp8StreamMaxRows); 0: never.
constexpr int64_t kSkinnyFp8StreamMinBytes = int64_t{2} << 20;
bool skinny_fp8_stream(int64_t m, int64_t n, int64_t k);

}  // namespace nucleus
