// All-reduce fused with the residual add and RMSNorm that follow it, for
// tensor parallelism inside one process (one thread per GPU, peer access
// enabled between the GPUs):
//
//   s[r, :]        = sum over ranks q = 0, 1, ... of f32(delta_q[r, :])   (rank order: every rank gets the same bits)
//   residual[r, :] = residual[r, :] + s[r, :]
//   out[r, :]      = bf16(residual[r, :] * rsqrt(mean(residual[r, :]^2) + eps) * w)
//   zero_fill[0 .. zero_fill_count) = 0   (optional: a prezero donor's fill, ops/prezero.h)
//
// The deltas are bf16, or f32 when they are a split-K GEMM's output
// (graph/passes/splitk_pass.h); every rank's of the same dtype. The add and
// norm are the plain add+norm kernel's row code (rmsnorm/add_rmsnorm_row.cuh),
// so at one rank the result is that kernel's, bit for bit.
//
// One kernel per rank, all ranks at once ("one-shot": each rank reads every
// peer's delta over NVLink and reduces all rows itself, which is what small
// decode-sized steps want; a ring all-reduce moves fewer bytes for large ones).
// Synchronisation follows vLLM's custom all-reduce
// (csrc/custom_all_reduce.cuh): CTA b of every rank writes a flag into CTA b's
// slot of each peer's signal buffer (st.release.sys) and waits for the peers'
// flags in its own (ld.acquire.sys) before reading, and again after reading,
// so no rank overwrites its delta while a peer still reads it. Flags are
// per-CTA counters kept in the signal buffer, so the kernel is safe under
// CUDA-graph capture and replay. Each CTA publishes its delta pointer in its
// signal slot before its flag, so deltas need no registration (buffers may
// move between calls). A peer that never arrives traps the kernel after
// kArWaitTimeoutNs instead of hanging the GPU. The prezero fill runs on
// fill_blocks extra CTAs after the row CTAs; they take no part in the
// barriers (so a rank's fill never waits for, or holds up, a peer).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace nucleus::kernels {

constexpr int kArMaxRanks = 8;
constexpr int kArMaxBlocks = 64;        // CTAs per rank at most (each handles whole rows)
constexpr int64_t kArMaxWidth = 8192;   // hidden sizes up to DeepSeek-V3's 7168
constexpr uint64_t kArWaitTimeoutNs = 10ull * 1000 * 1000 * 1000;

// Bytes of one rank's signal buffer. Zero it once before the first call; then
// leave it to the kernel (every rank's must have seen the same calls).
size_t allreduce_signal_bytes();

struct AllReduceNormParams {
  void* signals[kArMaxRanks] = {};      // every rank's signal buffer [allreduce_signal_bytes()], by rank;
                                        // device memory this GPU can access (peer access)
  int rank = 0;                         // this rank, in [0, world_size)
  int world_size = 1;                   // ranks in the group, [1, kArMaxRanks]
  const void* delta = nullptr;          // [rows, width] bf16, or f32 when delta_f32: this rank's partial
                                        // sum (peers read it)
  bool delta_f32 = false;               // the same on every rank
  float* residual = nullptr;            // [rows, width] f32: in/out
  const float* weight = nullptr;        // [width] f32
  __nv_bfloat16* out = nullptr;         // [rows, width] bf16
  int64_t rows = 0;                     // may be 0 (nothing launched)
  int64_t width = 0;                    // multiple of 8, at most kArMaxWidth
  float eps = 1e-6f;
  int max_blocks = kArMaxBlocks;        // row CTAs at most, [1, kArMaxBlocks]; the same on every rank
  float* zero_fill = nullptr;           // prezero: [zero_fill_count] f32 zeroed by this rank, or null
  int64_t zero_fill_count = 0;
  int fill_blocks = 0;                  // extra CTAs for the fill (>= 1 when zero_fill_count > 0)
};

// Why the kernel cannot run `p` (a static string), or null when it can:
// rank/world_size outside their ranges, a missing signal buffer, width not a
// multiple of 8 or above kArMaxWidth, pointers not 16-byte aligned, a fill
// without fill blocks.
const char* allreduce_add_rmsnorm_unsupported(const AllReduceNormParams& p);

// Launches the fused kernel on `stream` (stream-async, graph-capturable).
// Every rank must launch it with the same rows, width and max_blocks, each on
// its own stream, without waiting for the others first (the ranks' kernels
// wait for each other). cudaErrorInvalidValue when unsupported.
cudaError_t launch_allreduce_add_rmsnorm(const AllReduceNormParams& p, cudaStream_t stream);

}  // namespace nucleus::kernels
