// The grouped GEMM of the cuda_grouped MoE backend (device code; included by
// moe_grouped_wgmma.cu for its helpers and by
// the moe_grouped_{up,down}_{bf16,fp8}.cu instantiation files only).
//
// One CTA computes a BM x BN tile of one expert's GEMM: rows are a range of
// the expert-sorted (token, k) pairs (an "m-tile" from the device-side work
// list that moe_align_kernel writes), columns a slice of the expert's weight
// rows. The grid is sized to an upper bound of m-tiles times the n-tiles;
// CTAs past the device-side tile count exit at once, so no host sync is
// needed and the launch can be captured in a CUDA graph.
//
//   UP   (kUp):  h[r, j]  = silu(x[tok(r)] . gate_e[j]) * (x[tok(r)] . up_e[j])
//                A rows gathered from x through sorted_pairs (no permuted copy
//                of x); a tile's BN weight rows are BN/2 gate rows and the BN/2
//                matching up rows, so SwiGLU runs in the epilogue.
//   DOWN (!kUp): y[r, n]  = h[r] . down_e[n]
//
// Tensor cores: mma.sync m16n8k16 bf16 -> f32, fragments by ldmatrix from
// 128-byte-swizzled shared memory, a cp.async pipeline of STAGES k-tiles of
// 64 (128 with register dequantization: two 64-k sub-tiles a stage, so that
// a stage and its barrier carry as many weight bytes as a bf16 one). FP8 (e4m3, block-scaled) weights are copied as bytes and, in one of
// two ways (kRegs):
//   shared:    dequantized once per k-tile into a bf16 shared tile (q * scale
//              rounded to bf16) read by ldmatrix; the conversion runs on the
//              conversion pipe (~4 of 6 instructions a pair of weights).
//   registers: each lane reads its fragments' e4m3 bytes from the byte tile
//              and converts them exactly to bf16 with integer ops
//              (fp8_detail::e4m3x4_to_bf16x4); the MMA sums of a k-tile are
//              multiplied by the block scale in f32 and added to the
//              accumulators (W8A16 with exact weights). Only for warp tiles
//              of at most 32 rows (the decode tiles, BM 16 and 32) and K a
//              multiple of 128 (the launcher takes the shared path otherwise).
// A tile's half lies inside one scale block, so one scale per half and k-tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/moe/moe_grouped.cuh"

namespace nucleus::kernels::moe_grouped {

constexpr int kBlockK = 64;  // k per pipeline stage: one 128-byte bf16 row

// Element offset of 16-byte chunk `chunk` (0..7) of row `row` in a tile of
// 64-element bf16 rows, XOR-swizzled so that ldmatrix's 8 rows hit 8 banks.
__device__ __forceinline__ int swz(int row, int chunk) { return row * kBlockK + ((chunk ^ (row & 7)) << 3); }

using cuda_common::pack_bf16x2;

// Two e4m3 bytes (low byte first) times `scale`, as bf16x2.
__device__ __forceinline__ uint32_t fp8x2_to_bf16x2(uint16_t q, float scale) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(q), __NV_E4M3);
  const float2 f = __half22float2(__half2(hr));
  return pack_bf16x2(f.x * scale, f.y * scale);
}

// Shared-memory bytes of one configuration (kRegs: no bf16 tile).
// A stage holds KSUB sub-tiles of 64 k: 2 with register dequantization (so
// a stage carries as many weight bytes as a bf16 one), else 1.
template <bool kRegs>
constexpr int k_subtiles() {
  return kRegs ? 2 : 1;
}

template <int BM, int BN, int STAGES, bool kFp8, bool kRegs>
constexpr int smem_bytes() {
  const int a = BM * kBlockK * 2, b = BN * kBlockK * (kFp8 ? 1 : 2);
  return STAGES * k_subtiles<kRegs>() * (a + b) + (kFp8 && !kRegs ? BN * kBlockK * 2 : 0);
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, bool kFp8, bool kUp, bool kRegs>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32, (WARPS_M * WARPS_N * 32 >= 256) ? 2 : 3)
    grouped_gemm_kernel(GemmArgs args) {
  constexpr int NT = WARPS_M * WARPS_N * 32;
  constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
  constexpr int MI = WM / 16, NI = WN / 8;
  constexpr int A_ITERS = BM * 8 / NT;                    // 16-byte chunks per thread per stage
  constexpr int B_CHUNKS_PER_ROW = kFp8 ? 4 : 8;
  constexpr int B_ITERS = BN * B_CHUNKS_PER_ROW / NT;
  constexpr int KSUB = k_subtiles<kRegs>();             // 64-k sub-tiles a stage
  constexpr int A_SUB = BM * kBlockK;                     // elements of one A sub-tile
  constexpr int B_SUB_BYTES = BN * kBlockK * (kFp8 ? 1 : 2);
  constexpr int A_STAGE = A_SUB * KSUB;                   // elements
  constexpr int B_STAGE_BYTES = B_SUB_BYTES * KSUB;
  static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile");
  static_assert(!kUp || NI % 4 == 0, "UP pairs gate and up fragments two by two");
  static_assert(A_ITERS >= 1 && BM * 8 % NT == 0 && BN * B_CHUNKS_PER_ROW % NT == 0, "load split");
  static_assert(!kRegs || (kFp8 && MI <= 2), "register dequantization: FP8 weights, warp tiles of <= 32 rows");

  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* a_smem = reinterpret_cast<__nv_bfloat16*>(smem);
  unsigned char* b_smem = smem + STAGES * A_STAGE * 2;
  __nv_bfloat16* b_bf16 = reinterpret_cast<__nv_bfloat16*>(b_smem + STAGES * B_STAGE_BYTES);  // FP8 only
  __shared__ float scales[2][kMaxKBlocks];  // FP8: [gate | up or down][k block]

  // PDL (programmatic dependent launch; a no-op when launched normally): UP
  // reads the work list of the align kernel just before it, so it waits
  // first, then lets its dependent (the split-K sum or DOWN) start. DOWN
  // reads the work list before waiting (align finished before UP's wait
  // returned) and issues its first weight stages, then waits for h.
  if constexpr (kUp) {
    pdl::wait_for_inputs();
    pdl::launch_dependents();
  }
  const int split = blockIdx.x % args.k_splits, tile_n = blockIdx.x / args.k_splits;
  const int tile = tile_n / args.n_tiles, n_tile = tile_n % args.n_tiles;
  // The work list is read through L2 (ld.global.cg): DOWN reads it before its
  // wait, and an L1 line of an earlier layer's list must not answer.
  // Align-free (GemmArgs::pair_experts): tile t is pair t, one row. Only
  // 16-row tiles (the launch's one-token steps); the other variants compile
  // without it.
  const bool align_free = BM == 16 && args.pair_experts != nullptr;
  const int expert = align_free ? (tile < args.num_pairs ? __ldcg(args.pair_experts + tile) : -1)
                                : (tile < __ldcg(args.num_tiles) ? __ldcg(args.tile_expert + tile) : -1);
  if (expert < 0 || (align_free && expert >= args.num_experts)) {  // past the work list, or an id out of range
    // DOWN still waits: with no tile at all (every id out of range) no CTA
    // would, and DOWN could complete before UP, breaking the chain that lets
    // the next chunk's align rewrite the workspace.
    if constexpr (!kUp) pdl::wait_for_inputs();
    return;
  }
  const int row0 = align_free ? tile : __ldcg(args.tile_row0 + tile);
  const int row_end = align_free ? tile + 1 : __ldcg(args.expert_offsets + expert + 1);
  const WeightView w = kUp ? args.experts[expert].gate_up : args.experts[expert].down;
  const int K = args.k;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  // UP: columns j0 .. j0 + BN/2 of h; DOWN: columns n0 .. n0 + BN of y.
  const int col0 = kUp ? n_tile * (BN / 2) : n_tile * BN;
  auto weight_row = [&](int r) -> int64_t {
    if constexpr (kUp) return r < BN / 2 ? col0 + r : args.n + col0 + (r - BN / 2);
    return col0 + r;
  };

  if constexpr (kFp8) {
    const int k_blocks = (K + w.block_k - 1) / w.block_k;
    const float* s0 = w.scale_inv + (weight_row(0) / w.block_n) * k_blocks;
    const float* s1 = w.scale_inv + (weight_row(BN - 1) / w.block_n) * k_blocks;
    for (int i = tid; i < k_blocks; i += NT) {
      scales[0][i] = s0[i];
      scales[1][i] = s1[i];
    }
  }

  // Offsets of this thread's A and B chunks (fixed over k; 32-bit to save
  // registers: the buffers hold fewer than 2^31 elements). A row past the
  // expert's end is zero-filled (a_off < 0).
  int a_off[A_ITERS];
#pragma unroll
  for (int it = 0; it < A_ITERS; ++it) {
    const int i = tid + it * NT, row = i >> 3, c = i & 7;
    const int r = row0 + row;
    int src_row = r;
    if constexpr (kUp) src_row = r < row_end ? (align_free ? r : args.sorted_pairs[r]) / args.top_k : 0;
    a_off[it] = r < row_end ? src_row * K + c * 8 : -1;
  }
  int b_off[B_ITERS];  // bytes
#pragma unroll
  for (int it = 0; it < B_ITERS; ++it) {
    const int i = tid + it * NT, row = i / B_CHUNKS_PER_ROW, c = i % B_CHUNKS_PER_ROW;
    b_off[it] = static_cast<int>(weight_row(row)) * K * (kFp8 ? 1 : 2) + c * 16;
  }
  const unsigned char* b_base = static_cast<const unsigned char*>(w.data);

  // Stage `slot` <- k-tile kt (KSUB sub-tiles of 64 k from k = kt * KSUB * 64):
  // the A rows (load_a) and the weight rows (load_b).
  auto load_a = [&](int slot, int kt) {
#pragma unroll
    for (int sub = 0; sub < KSUB; ++sub) {
      const int k0 = (kt * KSUB + sub) * kBlockK;
      __nv_bfloat16* as = a_smem + slot * A_STAGE + sub * A_SUB;
#pragma unroll
      for (int it = 0; it < A_ITERS; ++it) {
        const int i = tid + it * NT, row = i >> 3, c = i & 7;
        const bool valid = a_off[it] >= 0;
        ptx::cp_async_16(as + swz(row, c), args.a + (valid ? a_off[it] + k0 : 0), valid ? 16 : 0);
      }
    }
  };
  auto load_b = [&](int slot, int kt) {
#pragma unroll
    for (int sub = 0; sub < KSUB; ++sub) {
      const int k0 = (kt * KSUB + sub) * kBlockK;
      unsigned char* bs = b_smem + slot * B_STAGE_BYTES + sub * B_SUB_BYTES;
#pragma unroll
      for (int it = 0; it < B_ITERS; ++it) {
        const int i = tid + it * NT, row = i / B_CHUNKS_PER_ROW, c = i % B_CHUNKS_PER_ROW;
        if constexpr (kFp8) {
          ptx::cp_async_16(bs + row * kBlockK + c * 16, b_base + b_off[it] + k0, 16);
        } else {
          ptx::cp_async_16(reinterpret_cast<__nv_bfloat16*>(bs) + swz(row, c), b_base + b_off[it] + k0 * 2, 16);
        }
      }
    }
  };
  auto load_stage = [&](int slot, int kt) {
    load_a(slot, kt);
    load_b(slot, kt);
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[mi][ni][v] = 0.0f;

  // This CTA's k-tiles [kt0, kt0 + k_tiles) (all of them without split-K).
  const int all_k_tiles = K / (kBlockK * KSUB);  // K % (64 * KSUB) == 0 (the launcher's check)
  const int kt0 = split * all_k_tiles / args.k_splits;
  const int k_tiles = (split + 1) * all_k_tiles / args.k_splits - kt0;
  // Prologue: the first STAGES - 1 stages' weights, then (DOWN: after the
  // wait for h) their A rows; stage s's copies all lie in commit groups
  // <= s, so the main loop's wait_group accounting is unchanged.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < k_tiles) load_b(s, kt0 + s);
  if constexpr (!kUp) {
    pdl::wait_for_inputs();
    pdl::launch_dependents();
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_a(s, kt0 + s);
    ptx::cp_async_commit();
  }

  // Shared-memory row of the first B row of n-fragment f of this warp.
  auto b_frag_row = [&](int f) -> int {
    if constexpr (kUp) return f < NI / 2 ? wn * (WN / 2) + f * 8 : BN / 2 + wn * (WN / 2) + (f - NI / 2) * 8;
    return wn * WN + f * 8;
  };

  for (int kt = 0; kt < k_tiles; ++kt) {
    ptx::cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt-1 fully consumed
    {
      const int next = kt + STAGES - 1;
      if (next < k_tiles) load_stage(next % STAGES, kt0 + next);
      ptx::cp_async_commit();
    }
    const int slot = kt % STAGES;
    const __nv_bfloat16* as = a_smem + slot * A_STAGE;
    if constexpr (kRegs) {
      // Lane (g, q) holds, for each of the k-tile's four k16 steps j, the
      // physical k columns 16q + 4j .. 16q + 4j + 3 of its rows: the MMA's
      // logical columns (2q, 2q+1) and (2q+8, 2q+9) of step j. A and B use
      // the same permutation of k, so the products and their sum are those
      // of the unpermuted tile. One 16-byte shared load a B fragment (row g,
      // bytes 16q..16q+15), two an A row (chunks 2q and 2q+1).
      const int g = lane >> 2, q = lane & 3;
#pragma unroll
      for (int sub = 0; sub < KSUB; ++sub) {
        const __nv_bfloat16* asub = as + sub * A_SUB;
        const unsigned char* bq = b_smem + slot * B_STAGE_BYTES + sub * B_SUB_BYTES;
        const int kb = ((kt0 + kt) * KSUB + sub) * kBlockK / w.block_k;
        const float s_lo = scales[0][kb], s_hi = scales[1][kb];
        uint4 ar[MI][2][2];  // [mi][row g, row g + 8][chunk 2q, 2q + 1]
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int c = 0; c < 2; ++c)
              ar[mi][h][c] = *reinterpret_cast<const uint4*>(asub + swz(wm * WM + mi * 16 + g + 8 * h, 2 * q + c));
        uint4 br[NI];
#pragma unroll
        for (int f = 0; f < NI; ++f)
          br[f] = *reinterpret_cast<const uint4*>(bq + (b_frag_row(f) + g) * kBlockK + 16 * q);
        float part[MI][NI][4];
        fp8_detail::zero_acc(part);
#pragma unroll
        for (int j = 0; j < kBlockK / 16; ++j) {
          uint32_t af[MI][4];
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            af[mi][0] = fp8_detail::word_of(ar[mi][0][j >> 1], 2 * (j & 1));
            af[mi][1] = fp8_detail::word_of(ar[mi][1][j >> 1], 2 * (j & 1));
            af[mi][2] = fp8_detail::word_of(ar[mi][0][j >> 1], 2 * (j & 1) + 1);
            af[mi][3] = fp8_detail::word_of(ar[mi][1][j >> 1], 2 * (j & 1) + 1);
          }
#pragma unroll
          for (int f = 0; f < NI; ++f) {
            uint32_t b0, b1;
            fp8_detail::e4m3x4_to_bf16x4(fp8_detail::word_of(br[f], j), b0, b1);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) ptx::mma_m16n8k16_bf16(part[mi][f], af[mi], b0, b1);
          }
        }
#pragma unroll
        for (int f = 0; f < NI; ++f) {
          const float sc = b_frag_row(f) < BN / 2 ? s_lo : s_hi;
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[mi][f][v] = fmaf(sc, part[mi][f][v], acc[mi][f][v]);
        }
      }
      continue;
    }
    const __nv_bfloat16* bs;
    if constexpr (kFp8) {
      const unsigned char* bq = b_smem + slot * B_STAGE_BYTES;
      const int kb = (kt0 + kt) * kBlockK / w.block_k;
      const float s_lo = scales[0][kb], s_hi = scales[1][kb];
      // 8 e4m3 bytes of B row `row`, chunk c -> 8 bf16 (q * scale) in the swizzled tile.
      auto convert = [&](int row, int c) {
        const uint2 q = *reinterpret_cast<const uint2*>(bq + row * kBlockK + c * 8);
        const float s = row < BN / 2 ? s_lo : s_hi;  // DOWN: both halves in one block
        uint4 v;
        v.x = fp8x2_to_bf16x2(static_cast<uint16_t>(q.x & 0xffff), s);
        v.y = fp8x2_to_bf16x2(static_cast<uint16_t>(q.x >> 16), s);
        v.z = fp8x2_to_bf16x2(static_cast<uint16_t>(q.y & 0xffff), s);
        v.w = fp8x2_to_bf16x2(static_cast<uint16_t>(q.y >> 16), s);
        *reinterpret_cast<uint4*>(b_bf16 + swz(row, c)) = v;
      };
      if constexpr (WARPS_M == 1) {
        // Each B row is read by one warp only: the warp converts its own rows
        // and needs no CTA barrier before its ldmatrix.
#pragma unroll
        for (int it = 0; it < WN / 4; ++it) {
          const int i = lane + it * 32, idx = i >> 3, c = i & 7;
          int row = wn * WN + idx;
          if constexpr (kUp) row = idx < WN / 2 ? wn * (WN / 2) + idx : BN / 2 + wn * (WN / 2) + (idx - WN / 2);
          convert(row, c);
        }
        __syncwarp();
      } else {
#pragma unroll
        for (int it = 0; it < BN * 8 / NT; ++it) {
          const int i = tid + it * NT;
          convert(i >> 3, i & 7);
        }
        __syncthreads();
      }
      bs = b_bf16;
    } else {
      bs = reinterpret_cast<const __nv_bfloat16*>(b_smem + slot * B_STAGE_BYTES);
    }

#pragma unroll
    for (int ks = 0; ks < kBlockK / 16; ++ks) {
      uint32_t af[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int row = wm * WM + mi * 16 + (lane & 15);
        ptx::ldmatrix_x4(af[mi], as + swz(row, ks * 2 + (lane >> 4)));
      }
      uint32_t bf[NI][2];
#pragma unroll
      for (int fp = 0; fp < NI / 2; ++fp) {
        const int row = b_frag_row(2 * fp) + (lane & 7) + ((lane >> 4) << 3);
        uint32_t r[4];
        ptx::ldmatrix_x4(r, bs + swz(row, ks * 2 + ((lane >> 3) & 1)));
        bf[2 * fp][0] = r[0];
        bf[2 * fp][1] = r[1];
        bf[2 * fp + 1][0] = r[2];
        bf[2 * fp + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) ptx::mma_m16n8k16_bf16(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  }
  ptx::cp_async_wait<0>();  // no copies outstanding at exit

  // Epilogue: fragment element (mi, ni, v) is row g (+8 for v >= 2), column 2q (+1 for odd v).
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + wm * WM + mi * 16 + g + half * 8;
      if (r >= row_end) continue;
      __nv_bfloat16* out_row = args.c + static_cast<int64_t>(r) * args.n;
      if (kUp && args.k_splits > 1) {
        // Split-K: raw f32 gate and up sums; moe_up_finish_kernel adds the splits.
        float* prow = args.partial + (static_cast<int64_t>(split) * args.partial_rows + r) * (2 * args.n);
#pragma unroll
        for (int f = 0; f < NI / 2; ++f) {
          const int j = col0 + wn * (WN / 2) + f * 8 + 2 * q;
          *reinterpret_cast<float2*>(prow + j) = make_float2(acc[mi][f][2 * half], acc[mi][f][2 * half + 1]);
          *reinterpret_cast<float2*>(prow + args.n + j) =
              make_float2(acc[mi][f + NI / 2][2 * half], acc[mi][f + NI / 2][2 * half + 1]);
        }
      } else if constexpr (kUp) {
#pragma unroll
        for (int f = 0; f < NI / 2; ++f) {
          const int j = col0 + wn * (WN / 2) + f * 8 + 2 * q;
          const float g0 = acc[mi][f][2 * half], g1 = acc[mi][f][2 * half + 1];
          const float u0 = acc[mi][f + NI / 2][2 * half], u1 = acc[mi][f + NI / 2][2 * half + 1];
          const float h0 = g0 / (1.0f + __expf(-g0)) * u0, h1 = g1 / (1.0f + __expf(-g1)) * u1;
          *reinterpret_cast<uint32_t*>(out_row + j) = pack_bf16x2(h0, h1);
        }
      } else {
#pragma unroll
        for (int f = 0; f < NI; ++f) {
          const int n = col0 + wn * WN + f * 8 + 2 * q;
          *reinterpret_cast<uint32_t*>(out_row + n) = pack_bf16x2(acc[mi][f][2 * half], acc[mi][f][2 * half + 1]);
        }
      }
    }
  }
}

// Launches one configuration over `max_tiles` m-tiles (an upper bound; the
// device-side count decides). Stream-async, graph-safe.
template <int BM, int BN, bool kFp8, bool kUp, bool kRegs>
cudaError_t launch_grouped_gemm_impl(const GemmArgs& args, int64_t max_tiles, cudaStream_t stream) {
  constexpr int WARPS_M = BM >= 128 ? 2 : 1, WARPS_N = 4;
  // Small FP8 tiles through shared memory: 3 stages keep 4 CTAs (16 warps)
  // on an SM; their loop, not memory latency, bounds a CTA's bandwidth.
  // Register dequantization: 3 stages of 128 k (2 in flight, 16 KB of UP
  // weights each) keep 3 CTAs on an SM.
  constexpr int STAGES = BM >= 128 ? 3 : (kFp8 ? 3 : 4);
  if constexpr (BM == 16 && !kFp8) {
    if (args.deep_ring) {  // moe_grouped_deep_ring: 8 stages, one CTA an SM
      constexpr int kDeep = 8;
      constexpr int deep_bytes = smem_bytes<BM, BN, kDeep, kFp8, kRegs>();
      auto deep = grouped_gemm_kernel<BM, BN, WARPS_M, WARPS_N, kDeep, kFp8, kUp, kRegs>;
      const cudaError_t attr = cuda_common::once_per_device(
          [&] { return cudaFuncSetAttribute(deep, cudaFuncAttributeMaxDynamicSharedMemorySize, deep_bytes); });
      if (attr != cudaSuccess) return attr;
      const int64_t blocks = max_tiles * args.n_tiles;
      if (blocks == 0) return cudaSuccess;
      if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
      return pdl::launch(deep, blocks, WARPS_M * WARPS_N * 32, deep_bytes, args.pdl, stream, args);
    }
  }
  constexpr int bytes = smem_bytes<BM, BN, STAGES, kFp8, kRegs>();
  auto kernel = grouped_gemm_kernel<BM, BN, WARPS_M, WARPS_N, STAGES, kFp8, kUp, kRegs>;
  const cudaError_t attr = cuda_common::once_per_device(
      [&] { return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); });
  if (attr != cudaSuccess) return attr;
  const int64_t blocks = max_tiles * args.n_tiles;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return pdl::launch(kernel, blocks, WARPS_M * WARPS_N * 32, bytes, args.pdl, stream, args);
}

}  // namespace nucleus::kernels::moe_grouped
