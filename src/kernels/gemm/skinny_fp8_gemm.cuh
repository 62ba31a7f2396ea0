// Skinny FP8 block-scaled GEMM for decode at batch 1..16 (DeepSeek-V3's
// 128x128 weight_scale_inv layout):
//   out[m, n] = (accumulate ? out[m, n] : 0) + sum_kb scale_inv[n / 128, kb] * sum_{k in kb} x[m, k] * q[n, k]
// with 1 <= m <= 16, x bf16, q float8 e4m3, scale_inv f32, k a multiple of
// 128 (kb = the 128-wide k blocks), f32 accumulation, bf16 or f32 out. This is
// the own FP8 path's W8A16 numerics (kernels/gemm/fp8_gemm.cuh): activations
// stay bf16 (no quantization pass), each e4m3 weight is converted exactly to
// bf16, so the only difference to the CPU reference gemm_ref(x,
// dequantize_fp8_block_ref(q, scale_inv)) is the f32 summation order.
//
// At a handful of rows the time is the weight's bytes over the bandwidth the
// kernel reaches, so the kernel keeps many weight bytes in flight on every SM
// and spends few instructions per byte:
//  - a warp owns 8 weight rows and a range of k blocks (one K slice); lane
//    (g, q) = (lane / 4, lane % 4) streams row g: per step it issues U = 8
//    16-byte loads (ld.global.nc, L1::no_allocate) of the 64-byte k chunks
//    c, c + 1, ... at byte 16 q, so one load instruction reads 64 contiguous
//    bytes of each of the 8 rows and a step 512 contiguous bytes a row;
//  - the products are tensor-core MMAs (mma.sync m16n8k16, bf16 in, f32
//    accumulate): the weights are the B operand (8 rows x 16 k), converted
//    e4m3 -> bf16 in registers with integer ops (fp8_common.cuh), the
//    activations the A operand (16 token rows x 16 k; rows past m repeat row
//    m - 1 and are never stored), read through L1 (every warp of the SM on the
//    same k range reuses them). One MMA covers 16 tokens, so m = 1 and m = 16
//    cost the same math; m > 8 adds one more x load per chunk;
//  - per 128-wide k block the MMA sums start from zero and are added to the
//    f32 accumulator times the block's scale (one FMA per output);
//  - the S warps of a CTA that share rows (S K slices, S in {1, 2, 4, 8, 16})
//    add their sums in shared memory in slice order: no atomics, no zeroing,
//    no workspace, bit-identical across runs.
// PDL: the kernel signals griddepcontrol.launch_dependents at its start and,
// launched with pdl, waits for its predecessor (griddepcontrol.wait) only
// after its first weight and scale loads are in flight, before it reads x or
// touches out.
// Bytes read: q once (n k), scale_inv once per warp slice, x once per SM from
// L2, out once (twice when accumulating).
//
// Framework-free: raw pointers, sizes and strides in elements, a stream; the
// launcher returns a cudaError_t. Stream-async and safe under CUDA-graph
// capture (nothing is allocated, nothing synchronises with the host).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

constexpr int64_t kSkinnyFp8MaxRows = 16;  // largest m
constexpr int kSkinnyFp8RowsPerWarp = 8;   // weight rows (output columns) a warp owns
constexpr int kSkinnyFp8Block = 128;       // scale block, both axes
constexpr int kSkinnyFp8MaxSlices = 16;

struct SkinnyFp8GemmArgs {
  const __nv_bfloat16* x = nullptr;  // [m, k] bf16, row stride x_stride; 16-byte aligned rows
  int64_t x_stride = 0;
  const uint8_t* w = nullptr;        // [n, k] e4m3 bytes, contiguous, 16-byte aligned
  const float* scale_inv = nullptr;  // [ceil(n / 128), k / 128] f32, contiguous
  void* out = nullptr;               // [m, n] bf16 or f32 (out_f32), row stride out_stride
  int64_t out_stride = 0;
  bool out_f32 = false;
  int64_t m = 0, n = 0, k = 0;
  bool accumulate = false;  // out += x W^T instead of out = x W^T
  int slices = 0;           // K slices per row group (1, 2, 4, 8 or 16); 0: skinny_fp8_default_slices
  // Launch as a programmatic dependent (PDL) of the previous kernel on the
  // stream: the CTAs may start while it finishes and stream their first
  // weights before waiting for it (griddepcontrol.wait) to read x or touch out.
  bool pdl = false;
  // Two steps of weight loads in flight a lane: the next step's 8 loads are
  // issued before this step's math (more bytes in flight an SM, for weights
  // of tens of MB and more), at 32 more registers a thread.
  bool pipelined = false;
  // The bf16 skinny kernel's scheme (skinny_gemm.cuh) over e4m3 weights: a
  // warp owns 4 rows, each load instruction reads 512 contiguous bytes of one
  // row, 4 steps in flight a lane (256 bytes); f32 FMAs on the weights
  // converted exactly in registers (W8A16, as the default scheme); its own
  // slice rule (skinny_fp8_stream_slices; slices 1, 2, 4 or 8). m <= 2; not
  // with pipelined. The e4m3 NaN codes (0x7f, 0xff) read as +-480 times the
  // scale here, not as NaN as in the default scheme. Measured (docs/perf.md "FP8 decode GEMMs: the bf16 skinny
  // kernel's load scheme"): 68-75% of the roofline on V3's 117-264 MB weights
  // at m = 1, where the default scheme and cuBLASLt reach 60-66%, and 75-86%
  // with the two-byte conversion ("FP8 stream GEMMs: e4m3 converted two bytes
  // at a time"); slower at m = 2.
  bool stream = false;
};

constexpr int64_t kSkinnyFp8StreamMaxRows = 2;
// The stream scheme's slice count for slices = 0: skinny_default_slices (the
// bf16 kernel's rule: ~11.7 warps an SM, each slice >= 32 chunks) over its
// 4-row groups and 16-byte (16 k) chunks, i.e. skinny_default_slices(1, n, k / 2).
int skinny_fp8_stream_slices(int64_t n, int64_t k, int num_sms);

// Whether the pipelined kernel pays at n x k (slices 0: the default count)
// on num_sms SMs: when its warps fit in one wave at its occupancy (two
// 8-warp CTAs an SM at ~120 registers a thread). Measured (docs/perf.md
// "Skinny FP8 decode GEMMs"): 10-25% faster where the grid fits one wave
// (V3 q_a, shared experts, o_proj), 25% slower on q_b's 1.5 waves.
bool skinny_fp8_pipelined_fits(int64_t n, int64_t k, int slices, int num_sms);

// Why the kernel refuses `a`, or nullptr when it takes it: needs
// 1 <= m <= 16, n >= 1, k >= 128 and k % 128 == 0, x_stride % 8 == 0 and
// >= k, out_stride >= n, x and w 16-byte aligned, scale_inv and out non-null,
// n and k below 2^31, slices 0, 1, 2, 4, 8 or 16; with stream also m <= 2,
// slices <= 8 and not pipelined.
const char* skinny_fp8_gemm_refusal(const SkinnyFp8GemmArgs& a);
// cudaSuccess when skinny_fp8_gemm_refusal(a) is nullptr, cudaErrorInvalidValue otherwise.
cudaError_t skinny_fp8_gemm_check(const SkinnyFp8GemmArgs& a);

// The slice count for slices = 0: the S in {1, 2, 4, 8, 16} whose warp count
// ceil(n / 8) * S is nearest to ~11.7 warps per SM (1,540 on 132 SMs), ties
// to the larger S, each slice at least two k blocks (256 k) deep. The target
// is the one measured for the bf16 skinny kernel (skinny_gemm.cuh), whose
// warps keep the same bytes per step in flight; to be confirmed for this
// kernel by bench/skinny_fp8_gemm_bench.cpp's slice sweep.
int skinny_fp8_default_slices(int64_t n, int64_t k, int num_sms);

// Runs the GEMM on `stream`. Errors: cudaErrorInvalidValue for what
// skinny_fp8_gemm_refusal names; launch errors.
cudaError_t launch_skinny_fp8_gemm(const SkinnyFp8GemmArgs& a, cudaStream_t stream);

}  // namespace nucleus::kernels
