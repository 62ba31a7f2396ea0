// The FP8 stream scheme's per-warp loop (device code; only for .cu files):
// the bf16 skinny kernel's load pattern over e4m3 weights with 128 x 128
// scale blocks. Used by the stream scheme of the skinny FP8 GEMM
// (skinny_fp8_gemm.cu, NUCLEUS_SKINNY_FP8_STREAM) and by the MoE UP GEMM
// of one-token steps (moe_up_stream.cu, NUCLEUS_MOE_UP_STREAM).
//
// A warp owns kRows = 4 weight rows and a range of their 16-byte chunks (16
// k each); lane l takes chunks begin + l, begin + l + 32, ...: each load
// instruction of the warp reads 512 contiguous bytes of one row, and U steps
// of 4 rows are in flight a lane (U x 64 bytes). The products are f32 FMAs:
// an e4m3 byte s.eeee.mmm becomes the f32 with bits s.0000eeee.mmm0...0, its
// value times 2^-120 exactly (normals and subnormals alike, an f32 subnormal
// for the latter; the NaN codes 0x7f / 0xff read as +-480), and x is
// multiplied by 2^60 (exact), so products and sums stay normal. Each chunk's
// 16 products are summed, scaled by the chunk's weight_scale_inv and added;
// the caller multiplies the final sums by kUnscale (2^60, exact).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/pdl.cuh"
#include "kernels/gemm/fp8_common.cuh"

namespace nucleus::kernels::fp8_stream {

constexpr int kRows = 4;     // weight rows a warp
constexpr int kWarps = 8;    // warps a CTA (kWarps / S row groups x S K slices)
constexpr int kSteps = 4;    // U: steps of 4 rows in flight a lane
constexpr int kChunk = 16;   // k (bytes of e4m3) a lane loads at once
constexpr int kChunksPerScale = 128 / kChunk;  // chunks of one 128-wide scale block
constexpr float k2p60 = 1152921504606846976.0f;  // 2^60
constexpr float kUnscale = k2p60;  // undoes 2^-120 (weights) * 2^60 (x)

// The four e4m3 bytes of w = [b3 b2 b1 b0] as f32 of their values times
// 2^-120, f[j] from byte j: each byte s.eeee.mmm becomes the f32 bits
// s.0000eeee.mmm0...0. Built as two bf16x2 words first (bytes 0 and 2, then
// 1 and 3: the bf16 bits s.0000eeee.mmm0000 of the same value), whose halves
// are f32 after one shift or mask each. Counting a shift and a three-input
// logic op (LOP3: and, and, or) as one instruction each: 2 shifts + 1 LOP3,
// 1 shift + 1 LOP3, then 4, i.e. 9 for four values, against 11 byte by byte
// (3 a byte, 2 for the top one). The same
// bits as the byte-by-byte form; measured 6-14% faster on every V3 and
// Kimi-K2 shape at m = 1 (docs/perf.md "FP8 stream GEMMs: e4m3 converted two
// bytes at a time").
__device__ __forceinline__ void e4m3x4_times_2m120(uint32_t w, float* f) {
  const uint32_t lo = ((w << 8) & 0x80008000u) | ((w << 4) & 0x07f007f0u);  // {b0, b2}
  const uint32_t hi = (w & 0x80008000u) | ((w >> 4) & 0x07f007f0u);         // {b1, b3}
  f[0] = __uint_as_float(lo << 16);
  f[1] = __uint_as_float(hi << 16);
  f[2] = __uint_as_float(lo & 0xffff0000u);
  f[3] = __uint_as_float(hi & 0xffff0000u);
}

// acc[r][mi] += sum over the warp's chunks c in [c_begin, c_end) taken by
// this lane of (w_r[c] . x_mi[c]) * scale_r[c / 8], in units of 2^-60:
//   wrow[r]: weight row r (k e4m3 bytes, 16-byte aligned);
//   srow[q]: the weight_scale_inv row (one f32 per 128 k) of rows
//            r = q * kRows / SR .. (q + 1) * kRows / SR - 1 (SR = 1: the 4
//            rows share one scale block row; 2: rows 0-1 and 2-3 each one);
//   xrow[mi]: activation row mi (bf16, 16-byte aligned).
// waited: whether the kernel has passed its PDL wait; if not, the first
// step's weight loads are issued before pdl::wait_for_inputs (the weights do
// not depend on the previous kernel, x does). A lane with no chunk returns
// without waiting: the caller waits again before reading outputs.
template <int M, int U, int SR>
__device__ __forceinline__ void accumulate_rows(const uint8_t* const (&wrow)[kRows], const float* const (&srow)[SR],
                                                const __nv_bfloat16* const (&xrow)[M], int c_begin, int c_end,
                                                int lane, bool waited, float (&acc)[kRows][M]) {
  static_assert(kRows % SR == 0, "scale rows split the warp's rows evenly");
  for (int c0 = c_begin + lane; c0 < c_end; c0 += 32 * U) {
    // Every weight and scale load of the U steps first, then the math.
    uint4 wv[U][kRows];
    float sc[U][SR];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        wv[u][r] = c < c_end ? fp8_detail::ld_stream_v4(wrow[r] + static_cast<int64_t>(c) * kChunk)
                             : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int q = 0; q < SR; ++q) sc[u][q] = c < c_end ? __ldg(srow[q] + static_cast<unsigned>(c) / kChunksPerScale) : 0.0f;
    }
    if (!waited) {
      pdl::wait_for_inputs();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= c_end) break;
      float xf[M][16];
#pragma unroll
      for (int mi = 0; mi < M; ++mi) {
        const uint4 x0 = __ldg(reinterpret_cast<const uint4*>(xrow[mi] + c * kChunk));
        const uint4 x1 = __ldg(reinterpret_cast<const uint4*>(xrow[mi] + c * kChunk + 8));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t a = fp8_detail::word_of(x0, i), b = fp8_detail::word_of(x1, i);
          xf[mi][2 * i] = __uint_as_float(a << 16) * k2p60;
          xf[mi][2 * i + 1] = __uint_as_float(a & 0xffff0000u) * k2p60;
          xf[mi][8 + 2 * i] = __uint_as_float(b << 16) * k2p60;
          xf[mi][8 + 2 * i + 1] = __uint_as_float(b & 0xffff0000u) * k2p60;
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float wf[16];
#pragma unroll
        for (int i = 0; i < 4; ++i) e4m3x4_times_2m120(fp8_detail::word_of(wv[u][r], i), &wf[4 * i]);
#pragma unroll
        for (int mi = 0; mi < M; ++mi) {
          float part = 0.0f;
#pragma unroll
          for (int e = 0; e < 16; ++e) part = fmaf(wf[e], xf[mi][e], part);
          acc[r][mi] = fmaf(part, sc[u][r * SR / kRows], acc[r][mi]);
        }
      }
    }
  }
}

}  // namespace nucleus::kernels::fp8_stream
