// The prefill-sized grouped MoE GEMM on Hopper tensor cores (wgmma, sm_90a):
// the UP and DOWN GEMMs of launch_moe_grouped for 128-row m-tiles
// (moe_grouped::launch_grouped_wgmma; the rule moe_grouped_wgmma says where).
//
// Same work list, same math and the same outputs (up to f32 summation order)
// as grouped_gemm_kernel<128, 128> (moe_grouped_gemm.cuh):
//   UP:   h[r, j] = bf16(silu(x[tok(r)] . gate_e[j]) * (x[tok(r)] . up_e[j]))
//   DOWN: y[r, n] = bf16(h[r] . down_e[n])
// with FP8 weights dequantized as that kernel's shared-memory path does
// (bf16(q * scale) per weight, the scale of its 128 x 128 block; the same
// fp8x2_to_bf16x2).
//
// One CTA: a 128 x 256 tile (128 sorted rows of one expert; UP: 128 gate
// columns and the 128 matching up columns, so SwiGLU runs in the epilogue;
// DOWN: 256 output columns), 2 warpgroups of 64 rows. Each k-tile of 64:
//   - every thread issues cp.async copies (A rows gathered through the
//     sorted order; weight rows) into a 4-stage ring of 128-byte-swizzled
//     tiles, two k-tiles ahead of the one multiplied;
//   - FP8: the k-tile's e4m3 bytes are converted to a bf16 swizzled tile
//     (two of them, alternating) by all threads, then a CTA barrier;
//   - each warpgroup issues 8 wgmma m64n128k16 (4 k16 steps x 2 column
//     halves) reading A and B from shared memory, and retires the previous
//     k-tile's group (wgmma.wait_group 1) so the tensor cores stay busy
//     while the next barrier and copies are issued.
// One CTA an SM (192 KB of shared memory; 128 f32 accumulators a thread).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wgmma.cuh"
#include "kernels/moe/moe_grouped.cuh"
#include "kernels/moe/moe_grouped_gemm.cuh"  // pack_bf16x2, fp8x2_to_bf16x2: the mma.sync kernel's epilogue and dequantization

namespace nucleus::kernels::moe_grouped {

namespace {

constexpr int kBM = 128;       // rows of a tile (two warpgroups of 64)
constexpr int kBN = 256;       // weight rows of a tile (UP: 128 gate + 128 up)
constexpr int kBK = 64;        // k per stage: one 128-byte bf16 row
constexpr int kStages = 4;     // ring slots; copies run two k-tiles ahead
constexpr int kThreads = 256;  // 2 warpgroups
constexpr int kATile = kBM * kBK * 2;  // bytes of one A stage (16 KB)
constexpr int kBTile = kBN * kBK * 2;  // bytes of one bf16 B tile (32 KB)

// Bytes of dynamic shared memory (plus 1 KB to align the tiles to 1024).
template <bool kFp8>
constexpr int wgmma_smem_bytes() {
  // bf16: kStages x (A + B); FP8: kStages x (A + B bytes) + two bf16 B tiles.
  return 1024 + (kFp8 ? kStages * (kATile + kBN * kBK) + 2 * kBTile : kStages * (kATile + kBTile));
}

template <bool kFp8, bool kUp>
__global__ void __launch_bounds__(kThreads, 1) grouped_wgmma_kernel(GemmArgs args) {
  extern __shared__ unsigned char smem_raw[];
  // Tiles 1024-byte aligned (the 128-byte swizzle's period).
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
  unsigned char* const base_ptr = smem_raw + (base - ptx::smem_u32(smem_raw));
  const uint32_t a_smem = base;                              // [kStages][kBM][128 B]
  const uint32_t b_smem = a_smem + kStages * kATile;         // [kStages][kBN][128 B] (FP8: [kBN][64 B])
  constexpr int kBStage = kFp8 ? kBN * kBK : kBTile;         // bytes of one B stage as copied
  const uint32_t b_conv = b_smem + kStages * kBStage;        // FP8: [2][kBN][128 B] bf16
  unsigned char* const b_raw_ptr = base_ptr + kStages * kATile;
  unsigned char* const b_conv_ptr = b_raw_ptr + kStages * kBStage;
  __shared__ float scales[2][kMaxKBlocks];  // FP8: [first | second 128 weight rows][k block]

  // PDL: the work list (align) and UP's h (DOWN) come from the launches
  // before; wait for them first, then let the next launch start its prologue.
  pdl::wait_for_inputs();
  pdl::launch_dependents();

  const int tile = blockIdx.x / args.n_tiles, n_tile = blockIdx.x % args.n_tiles;
  const int expert = tile < __ldcg(args.num_tiles) ? __ldcg(args.tile_expert + tile) : -1;
  if (expert < 0) return;  // past the work list
  const int row0 = __ldcg(args.tile_row0 + tile);
  const int row_end = __ldcg(args.expert_offsets + expert + 1);
  const WeightView w = kUp ? args.experts[expert].gate_up : args.experts[expert].down;
  const int K = args.k;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, w4 = warp & 3;
  // UP: columns col0 .. col0 + 127 of h (gate rows col0.., up rows n + col0..);
  // DOWN: columns col0 .. col0 + 255 of y.
  const int col0 = n_tile * (kUp ? kBN / 2 : kBN);
  auto weight_row = [&](int r) -> int {
    if constexpr (kUp) return r < kBN / 2 ? col0 + r : args.n + col0 + (r - kBN / 2);
    return col0 + r;
  };

  if constexpr (kFp8) {
    // Each half of the tile's weight rows (128 rows, 128-aligned) lies in one
    // scale block row (block_n a multiple of 128: moe_grouped_unsupported).
    const int k_blocks = (K + w.block_k - 1) / w.block_k;
    const float* s0 = w.scale_inv + (weight_row(0) / w.block_n) * k_blocks;
    const float* s1 = w.scale_inv + (weight_row(kBN / 2) / w.block_n) * k_blocks;
    for (int i = tid; i < k_blocks; i += kThreads) {
      scales[0][i] = s0[i];
      scales[1][i] = s1[i];
    }
  }

  // Thread t copies 16-byte chunk t % 8 of rows t / 8 + 32 i (bf16 tiles):
  // every one of its rows has the same swizzled chunk.
  const int r_lo = tid >> 3, c8 = tid & 7;
  const uint32_t swz_off = r_lo * 128 + ((c8 ^ (r_lo & 7)) << 4);
  constexpr int kAIters = kBM / 32;
  int a_off[kAIters];  // element offset of the chunk's row in A, -1 past the expert's rows (zero-filled)
#pragma unroll
  for (int it = 0; it < kAIters; ++it) {
    const int r = row0 + r_lo + 32 * it;
    int src = r;
    if constexpr (kUp) src = r < row_end ? args.sorted_pairs[r] / args.top_k : 0;
    a_off[it] = r < row_end ? src * K + c8 * 8 : -1;
  }
  // B: bf16, the same pattern over 256 rows; FP8, 4 chunks of 16 bytes a
  // 64-byte row, thread t copies chunk t % 4 of rows t / 4 + 64 i.
  constexpr int kBIters = kFp8 ? kBN * 4 / kThreads : kBN * 8 / kThreads;
  int b_off[kBIters];  // byte offset in the expert's weight
#pragma unroll
  for (int it = 0; it < kBIters; ++it) {
    if constexpr (kFp8) {
      b_off[it] = weight_row((tid >> 2) + 64 * it) * K + (tid & 3) * 16;
    } else {
      b_off[it] = (weight_row(r_lo + 32 * it) * K + c8 * 8) * 2;
    }
  }
  const unsigned char* const b_base = static_cast<const unsigned char*>(w.data);
  const __nv_bfloat16* const a_base = args.a;

  auto load_stage = [&](int slot, int kt) {
    const int k0 = kt * kBK;
    const uint32_t as = a_smem + slot * kATile + swz_off;
#pragma unroll
    for (int it = 0; it < kAIters; ++it) {
      const bool valid = a_off[it] >= 0;
      ptx::cp_async_16(as + it * 32 * 128, a_base + (valid ? a_off[it] + k0 : 0), valid ? 16 : 0);
    }
    if constexpr (kFp8) {
      const uint32_t bs = b_smem + slot * kBStage + (tid >> 2) * kBK + (tid & 3) * 16;
#pragma unroll
      for (int it = 0; it < kBIters; ++it) ptx::cp_async_16(bs + it * 64 * kBK, b_base + b_off[it] + k0, 16);
    } else {
      const uint32_t bs = b_smem + slot * kBStage + swz_off;
#pragma unroll
      for (int it = 0; it < kBIters; ++it) ptx::cp_async_16(bs + it * 32 * 128, b_base + b_off[it] + k0 * 2, 16);
    }
  };

  float acc0[16][4], acc1[16][4];  // columns 0..127 and 128..255 of the tile (UP: gate, up)
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc0[j][v] = acc1[j][v] = 0.0f;

  const int k_tiles = K / kBK;  // K % 64 == 0 (moe_grouped_wgmma)
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < k_tiles) load_stage(s, s);
    ptx::cp_async_commit();
  }

  for (int kt = 0; kt < k_tiles; ++kt) {
    // k-tile kt's copies are group kt; groups kt + 1 .. kt + kStages - 3 may stay in flight.
    ptx::cp_async_wait<kStages - 3>();
    wgmma::fence_proxy_async();
    // Every thread's copies of k-tile kt landed; both warpgroups retired
    // k-tile kt - 2's wgmma (wait<1> in iteration kt - 1), so its slot is free.
    __syncthreads();
    {
      const int next = kt + kStages - 2;
      if (next < k_tiles) load_stage(next % kStages, next);
      ptx::cp_async_commit();
    }
    const int slot = kt % kStages;
    uint32_t b_tile = b_smem + slot * kBStage;
    if constexpr (kFp8) {
      // e4m3 bytes of k-tile kt -> bf16(q * scale) into conversion tile kt % 2
      // (its last reader, k-tile kt - 2's wgmma, has retired). Thread t:
      // 8-byte piece t % 8 of rows t / 8 + 32 i.
      const unsigned char* raw = b_raw_ptr + slot * kBStage;
      unsigned char* conv = b_conv_ptr + (kt & 1) * kBTile;
      const int kb = kt * kBK / w.block_k;
      const float s_lo = scales[0][kb], s_hi = scales[1][kb];
#pragma unroll
      for (int it = 0; it < kBN / 32; ++it) {
        const int row = r_lo + 32 * it;
        const uint2 q = *reinterpret_cast<const uint2*>(raw + row * kBK + c8 * 8);
        const float s = row < kBN / 2 ? s_lo : s_hi;
        uint4 v;
        v.x = fp8x2_to_bf16x2(static_cast<uint16_t>(q.x & 0xffff), s);
        v.y = fp8x2_to_bf16x2(static_cast<uint16_t>(q.x >> 16), s);
        v.z = fp8x2_to_bf16x2(static_cast<uint16_t>(q.y & 0xffff), s);
        v.w = fp8x2_to_bf16x2(static_cast<uint16_t>(q.y >> 16), s);
        *reinterpret_cast<uint4*>(conv + swz_off + it * 32 * 128) = v;
      }
      wgmma::fence_proxy_async();
      __syncthreads();
      b_tile = b_conv + (kt & 1) * kBTile;
    }
    const uint32_t a_tile = a_smem + slot * kATile + wg * 64 * 128;  // this warpgroup's 64 rows
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      const uint64_t da = wgmma::smem_desc(a_tile + kk * 32, 16, 1024);
      wgmma::m64n128k16_ss(acc0, da, wgmma::smem_desc(b_tile + kk * 32, 16, 1024));
      wgmma::m64n128k16_ss(acc1, da, wgmma::smem_desc(b_tile + (kBN / 2) * 128 + kk * 32, 16, 1024));
    }
    wgmma::commit();
    wgmma::wait<1>();
  }
  wgmma::wait<0>();
  ptx::cp_async_wait<0>();  // no copies outstanding at exit

  // Epilogue: accumulator (j, v) is row 16 w4 + g (+8 for v >= 2) of this
  // warpgroup's 64, column 8 j + 2 q (+1 for odd v) of its half.
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + wg * 64 + w4 * 16 + g + 8 * half;
    if (r >= row_end) continue;
    __nv_bfloat16* out_row = args.c + static_cast<int64_t>(r) * args.n;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = col0 + 8 * j + 2 * q;
      if constexpr (kUp) {
        const float g0 = acc0[j][2 * half], g1 = acc0[j][2 * half + 1];
        const float u0 = acc1[j][2 * half], u1 = acc1[j][2 * half + 1];
        const float h0 = g0 / (1.0f + __expf(-g0)) * u0, h1 = g1 / (1.0f + __expf(-g1)) * u1;
        *reinterpret_cast<uint32_t*>(out_row + c) = pack_bf16x2(h0, h1);
      } else {
        *reinterpret_cast<uint32_t*>(out_row + c) = pack_bf16x2(acc0[j][2 * half], acc0[j][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(out_row + c + kBN / 2) = pack_bf16x2(acc1[j][2 * half], acc1[j][2 * half + 1]);
      }
    }
  }
}

template <bool kFp8, bool kUp>
cudaError_t launch_variant(const GemmArgs& args, int64_t max_tiles, cudaStream_t stream) {
  constexpr int bytes = wgmma_smem_bytes<kFp8>();
  auto kernel = grouped_wgmma_kernel<kFp8, kUp>;
  const cudaError_t attr = cuda_common::once_per_device(
      [&] { return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); });
  if (attr != cudaSuccess) return attr;
  GemmArgs a = args;
  a.n_tiles = kUp ? a.n / (kBN / 2) : a.n / kBN;
  const int64_t blocks = max_tiles * a.n_tiles;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return pdl::launch(kernel, blocks, kThreads, bytes, a.pdl, stream, a);
}

// W8A8: e4m3 A (x or h quantized per 1 x 128 block) times e4m3 weights on FP8
// wgmma. A CTA: 128 rows x 128 weight rows (UP: 64 gate + the 64 matching up
// rows; DOWN: 128 output columns), 2 warpgroups of 64 rows, k-tiles of 128
// (one scale block: 128 bytes a row, the 128-byte swizzle). Per k-tile each
// warpgroup issues 4 wgmma m64n128k32 into a block accumulator, retires them,
// and adds block * a_scale(row) * w_scale(half) to its f32 accumulators.
// A 5-stage cp.async ring, 4 k-tiles ahead; each stage also carries the
// tile's 128 A scales.
constexpr int kQBN = 128;                 // weight rows a tile
constexpr int kQBK = 128;                 // k a stage (bytes of an e4m3 row)
constexpr int kQStages = 5;
constexpr int kQTile = kBM * kQBK;        // bytes of an A (or B) stage: 16 KB
static_assert(kQBN * kQBK == kQTile, "A and B stages of one size");

constexpr int w8a8_smem_bytes() { return 1024 + kQStages * (2 * kQTile + kBM * 4); }

template <bool kUp>
__global__ void __launch_bounds__(kThreads, 1) grouped_wgmma_w8a8_kernel(GemmArgs args) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
  unsigned char* const base_ptr = smem_raw + (base - ptx::smem_u32(smem_raw));
  const uint32_t a_smem = base;                         // [kQStages][128 rows][128 B]
  const uint32_t b_smem = a_smem + kQStages * kQTile;   // [kQStages][128 rows][128 B]
  const uint32_t as_smem = b_smem + kQStages * kQTile;  // [kQStages][128] f32 A scales
  const float* const a_scales = reinterpret_cast<const float*>(base_ptr + 2 * kQStages * kQTile);
  __shared__ float w_scales[2][kMaxKBlocks];  // [first | second 64 weight rows][k block]

  pdl::wait_for_inputs();
  pdl::launch_dependents();

  const int tile = blockIdx.x / args.n_tiles, n_tile = blockIdx.x % args.n_tiles;
  const int expert = tile < __ldcg(args.num_tiles) ? __ldcg(args.tile_expert + tile) : -1;
  if (expert < 0) return;
  const int row0 = __ldcg(args.tile_row0 + tile);
  const int row_end = __ldcg(args.expert_offsets + expert + 1);
  const WeightView w = kUp ? args.experts[expert].gate_up : args.experts[expert].down;
  const int K = args.k, k_blocks = K / kQBK;  // the weights' block_k is 128 (moe_grouped_w8a8: the shape's)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, w4 = warp & 3;
  // UP: h columns col0 .. col0 + 63 (gate rows col0.., up rows n + col0..);
  // DOWN: y columns col0 .. col0 + 127. Each half of the weight rows lies in
  // one 128-row scale block (block_n a multiple of 128, n % 128 == 0).
  const int col0 = n_tile * (kUp ? kQBN / 2 : kQBN);
  auto weight_row = [&](int r) -> int {
    if constexpr (kUp) return r < kQBN / 2 ? col0 + r : args.n + col0 + (r - kQBN / 2);
    return col0 + r;
  };
  {
    const float* s0 = w.scale_inv + (weight_row(0) / w.block_n) * k_blocks;
    const float* s1 = w.scale_inv + (weight_row(kQBN / 2) / w.block_n) * k_blocks;
    for (int i = tid; i < k_blocks; i += kThreads) {
      w_scales[0][i] = s0[i];
      w_scales[1][i] = s1[i];
    }
  }
  auto src_row = [&](int r) -> int {  // A row of sorted row r (< row_end)
    if constexpr (kUp) return args.sorted_pairs[r] / args.top_k;
    return r;
  };
  const int r_lo = tid >> 3, c8 = tid & 7;
  const uint32_t swz_off = r_lo * 128 + ((c8 ^ (r_lo & 7)) << 4);
  int a_off[4], b_off[4];  // byte offsets of this thread's 16-byte chunks (a: -1 past the expert's rows)
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int r = row0 + r_lo + 32 * it;
    a_off[it] = r < row_end ? src_row(r) * K + c8 * 16 : -1;
    b_off[it] = weight_row(r_lo + 32 * it) * K + c8 * 16;
  }
  // Threads 0..127 copy the A scale of tile row tid each stage (0 past the rows).
  const int s_off = tid < kBM && row0 + tid < row_end ? src_row(row0 + tid) * k_blocks : -1;
  const unsigned char* const a_base = args.a_fp8;
  const unsigned char* const b_base = static_cast<const unsigned char*>(w.data);

  auto load_stage = [&](int slot, int kt) {
    const int k0 = kt * kQBK;
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const bool valid = a_off[it] >= 0;
      ptx::cp_async_16(a_smem + slot * kQTile + swz_off + it * 32 * 128, a_base + (valid ? a_off[it] + k0 : 0),
                       valid ? 16 : 0);
      ptx::cp_async_16(b_smem + slot * kQTile + swz_off + it * 32 * 128, b_base + b_off[it] + k0, 16);
    }
    if (tid < kBM)
      ptx::cp_async_4(as_smem + (slot * kBM + tid) * 4, args.a_scale + (s_off >= 0 ? s_off + kt : 0),
                      s_off >= 0 ? 4 : 0);
  };

  float acc[16][4], blk[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[j][v] = blk[j][v] = 0.0f;

#pragma unroll
  for (int s = 0; s < kQStages - 1; ++s) {
    if (s < k_blocks) load_stage(s, s);
    ptx::cp_async_commit();
  }
  const int g = lane >> 2, q = lane & 3;
  const int my_row = wg * 64 + w4 * 16 + g;  // tile rows my_row and my_row + 8
  for (int kt = 0; kt < k_blocks; ++kt) {
    ptx::cp_async_wait<kQStages - 2>();
    wgmma::fence_proxy_async();
    // k-tile kt landed for every thread; both warpgroups retired k-tile kt - 1
    // (wait<0> below), so its slot takes k-tile kt + kQStages - 1.
    __syncthreads();
    {
      const int next = kt + kQStages - 1;
      if (next < k_blocks) load_stage(next % kQStages, next);
      ptx::cp_async_commit();
    }
    const int slot = kt % kQStages;
    const uint32_t a_tile = a_smem + slot * kQTile + wg * 64 * 128, b_tile = b_smem + slot * kQTile;
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kQBK / 32; ++kk)
      wgmma::m64n128k32_e4m3_ss(blk, wgmma::smem_desc(a_tile + kk * 32, 16, 1024),
                                wgmma::smem_desc(b_tile + kk * 32, 16, 1024), kk > 0);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(blk);  // the reads below stay after the wait
    const float sa0 = a_scales[slot * kBM + my_row], sa1 = a_scales[slot * kBM + my_row + 8];
    const float sw_lo = w_scales[0][kt], sw_hi = w_scales[1][kt];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float sw = j < 8 ? sw_lo : sw_hi;
      const float s0 = sa0 * sw, s1 = sa1 * sw;
      acc[j][0] = fmaf(blk[j][0], s0, acc[j][0]);
      acc[j][1] = fmaf(blk[j][1], s0, acc[j][1]);
      acc[j][2] = fmaf(blk[j][2], s1, acc[j][2]);
      acc[j][3] = fmaf(blk[j][3], s1, acc[j][3]);
    }
  }
  ptx::cp_async_wait<0>();

  // Epilogue: acc (j, v) is tile row my_row (+8 for v >= 2), weight row 8 j + 2 q (+1 for odd v).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + my_row + 8 * half;
    if (r >= row_end) continue;
    __nv_bfloat16* out_row = args.c + static_cast<int64_t>(r) * args.n;
    if constexpr (kUp) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float g0 = acc[j][2 * half], g1 = acc[j][2 * half + 1];
        const float u0 = acc[j + 8][2 * half], u1 = acc[j + 8][2 * half + 1];
        const float h0 = g0 / (1.0f + __expf(-g0)) * u0, h1 = g1 / (1.0f + __expf(-g1)) * u1;
        *reinterpret_cast<uint32_t*>(out_row + col0 + 8 * j + 2 * q) = pack_bf16x2(h0, h1);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<uint32_t*>(out_row + col0 + 8 * j + 2 * q) = pack_bf16x2(acc[j][2 * half], acc[j][2 * half + 1]);
    }
  }
}

template <bool kUp>
cudaError_t launch_w8a8_variant(const GemmArgs& args, int64_t max_tiles, cudaStream_t stream) {
  constexpr int bytes = w8a8_smem_bytes();
  auto kernel = grouped_wgmma_w8a8_kernel<kUp>;
  const cudaError_t attr = cuda_common::once_per_device(
      [&] { return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); });
  if (attr != cudaSuccess) return attr;
  GemmArgs a = args;
  a.n_tiles = kUp ? a.n / (kQBN / 2) : a.n / kQBN;
  const int64_t blocks = max_tiles * a.n_tiles;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return pdl::launch(kernel, blocks, kThreads, bytes, a.pdl, stream, a);
}

}  // namespace

bool wgmma_shape_ok(int64_t hidden, int64_t inter) {
  return inter % (kBN / 2) == 0 && hidden % kBN == 0 && hidden % kBK == 0 && inter % kBK == 0;
}

cudaError_t launch_grouped_wgmma(bool fp8, bool up, const GemmArgs& args, int64_t max_tiles, cudaStream_t stream) {
  if (args.k_splits != 1 || args.pair_experts != nullptr || args.k % kBK != 0 ||
      args.n % (up ? kBN / 2 : kBN) != 0)
    return cudaErrorInvalidValue;
  if (up) return fp8 ? launch_variant<true, true>(args, max_tiles, stream) : launch_variant<false, true>(args, max_tiles, stream);
  return fp8 ? launch_variant<true, false>(args, max_tiles, stream) : launch_variant<false, false>(args, max_tiles, stream);
}

cudaError_t launch_grouped_wgmma_w8a8(bool up, const GemmArgs& args, int64_t max_tiles, cudaStream_t stream) {
  if (args.k_splits != 1 || args.pair_experts != nullptr || args.k % kQBK != 0 || args.n % kQBN != 0 ||
      args.a_fp8 == nullptr || args.a_scale == nullptr || args.k / kQBK > kMaxKBlocks)
    return cudaErrorInvalidValue;
  return up ? launch_w8a8_variant<true>(args, max_tiles, stream) : launch_w8a8_variant<false>(args, max_tiles, stream);
}

}  // namespace nucleus::kernels::moe_grouped
