// Expanded-form MLA prefill attention (see mla_prefill.cuh for the math).
//
// Two variants of one kernel (MlaPrefillParams::use_wgmma), same data flow:
//  - mma.sync: each warp computes its 16 rows with mma.sync m16n8k16, operands
//    from shared memory through ldmatrix;
//  - wgmma (sm_90a): each warpgroup (4 warps, 64 rows) issues wgmma
//    m64n64k16 for S = Q K^T (Q and K read by the tensor cores from shared
//    memory) and m64n128k16 for O += P V (P from registers, V from shared
//    memory, transposed), so K/V are not re-read per warp.
// The register layouts of S, P and O per warp are the same in both, so the
// softmax, masking and epilogue code is shared.
//
// Per CTA: kWarps warps, each owning 16 query rows of one head; the Q tile in
// shared memory for the CTA's life; K (64 x 192, two buffers) and V
// (64 x 128, one buffer) tiles streamed with cp.async: K(t+1) and V(t) are
// issued together at the start of tile t, V(t) lands while S = Q K(t)^T runs,
// K(t+1) while the whole tile runs. Shared tiles are stored as column blocks
// of 64 bf16 (128-byte rows, each block 1024-byte aligned) with 16-byte
// chunks XOR-swizzled by (row & 7): the tensor cores' 128-byte swizzle, and
// conflict-free ldmatrix. Scores stay in registers (C fragments) and become
// the bf16 A fragments of P.V without a trip through shared memory.
// Measured on an H200: docs/perf.md, "MLA prefill attention".
#include "kernels/mla/mla_prefill.cuh"

#include <cmath>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wgmma.cuh"

namespace nucleus::kernels {

namespace {

constexpr int kQk = kMlaPrefillQkDim;  // 192
constexpr int kV = kMlaPrefillVDim;     // 128
constexpr int kBlockN = 64;             // keys per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Byte offset of 16-byte chunk `chunk` (8 bf16) of row `row` in a tile of
// kRows rows: column block chunk / 8 ([kRows][128 B]), 128-byte swizzle.
template <int kRows>
__device__ __forceinline__ uint32_t tile_off(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

using cuda_common::pack_bf16x2;

// Copies rows [0, kRows) of a global tile (kBlocks * 64 bf16 wide, row stride
// `stride` elements) into the swizzled shared tile at s_tile; rows at or
// past `valid_rows` are zero-filled (`dummy` is their unread source). Thread t
// copies chunk t % 8 of rows t / 8 + i * (kThreads / 8) of every column
// block: its swizzled chunk is the same for all of them.
template <int kRows, int kBlocks, int kThreads>
__device__ __forceinline__ void load_tile(uint32_t s_tile, const __nv_bfloat16* g, int64_t stride, int valid_rows,
                                          const void* dummy) {
  constexpr int kRowStep = kThreads / 8;
  static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "rows of a thread share their swizzle");
  const int rest = threadIdx.x >> 3, c8 = threadIdx.x & 7;
  const uint32_t s0 = s_tile + rest * 128 + ((c8 ^ (rest & 7)) << 4);
  const __nv_bfloat16* g0 = g + rest * stride + c8 * 8;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const bool ok = rest + i * kRowStep < valid_rows;
    const __nv_bfloat16* gi = g0 + i * kRowStep * stride;
#pragma unroll
    for (int b = 0; b < kBlocks; ++b)
      ptx::cp_async_16(s0 + b * (kRows * 128) + i * kRowStep * 128, ok ? gi + b * 64 : dummy, ok ? 16 : 0);
  }
}

// wgmma with 128-row tiles: 128 registers, so two CTAs share an SM (one's
// softmax overlaps the other's matrix products); the others need more.
template <int kWarps, bool kWgmma>
__global__ void __launch_bounds__(kWarps * 32, kWgmma && kWarps == 8 ? 2 : 1) mla_prefill_kernel(
    const MlaPrefillParams p) {
  constexpr int kBlockM = kWarps * 16;
  constexpr int kThreads = kWarps * 32;
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t s_q = (ptx::smem_u32(smem) + 1023u) & ~1023u;  // 1024-aligned for the 128-byte swizzle
  const uint32_t s_k = s_q + kBlockM * kQk * 2;
  const uint32_t s_v = s_k + 2 * kBlockN * kQk * 2;  // after two K buffers

  const MlaPrefillWork w = p.work[blockIdx.x];
  const MlaPrefillSeq sq = p.seqs[w.seq];
  const int h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int m0 = w.q_tile * kBlockM;             // the tile's first query (sequence-local)
  const int rows = min(kBlockM, sq.num_q - m0);  // valid query rows of the tile
  if (rows <= 0) return;
  // Keys the tile's last row sees: [key_begin, key_stop).
  const int key_stop = min(sq.key_end, sq.q_pos0 + m0 + rows);
  const int num_key_tiles = key_stop > sq.key_begin ? (key_stop - sq.key_begin + kBlockN - 1) / kBlockN : 0;
  if (num_key_tiles == 0 && p.merge) return;  // nothing visible: old values stand

  load_tile<kBlockM, kQk / 64, kThreads>(s_q, p.q + static_cast<int64_t>(sq.q_row0 + m0) * p.q_stride + h * kQk,
                                         p.q_stride, rows, p.q);
  // Key tile t: keys key_begin + 64 t + r, rows of k / v at kv_row0 + 64 t + r; rows past key_stop are
  // zero-filled (P is 0 there, and 0 * 0 stays finite).
  auto load_k = [&](int t) {
    load_tile<kBlockN, kQk / 64, kThreads>(
        s_k + (t & 1) * (kBlockN * kQk * 2),
        p.k + static_cast<int64_t>(sq.kv_row0 + t * kBlockN) * p.k_stride + h * kQk, p.k_stride,
        key_stop - sq.key_begin - t * kBlockN, p.k);
  };
  auto load_v = [&](int t) {
    load_tile<kBlockN, kV / 64, kThreads>(s_v,
                                          p.v + static_cast<int64_t>(sq.kv_row0 + t * kBlockN) * p.v_stride + h * kV,
                                          p.v_stride, key_stop - sq.key_begin - t * kBlockN, p.v);
  };
  if (num_key_tiles > 0) load_k(0);
  ptx::cp_async_commit();

  // This thread's rows of the C fragments: g and g + 8 of the warp's 16.
  const int g = lane >> 2, t4 = lane & 3;
  const int row_lo = m0 + warp * 16 + g;  // sequence-local query index
  const int pos_lo = sq.q_pos0 + row_lo, pos_hi = pos_lo + 8;
  const int warp_pos0 = sq.q_pos0 + m0 + warp * 16;  // the warp's first row position
  const float scale_log2 = p.scale * kLog2e;

  float o[kV / 8][4];
#pragma unroll
  for (int j = 0; j < kV / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of raw scores per row
  float l_run[2] = {0.0f, 0.0f};            // this thread's part of the running sum

  for (int t = 0; t < num_key_tiles; ++t) {
    const int key0 = sq.key_begin + t * kBlockN;
    const uint32_t s_kt = s_k + (t & 1) * (kBlockN * kQk * 2);
    ptx::cp_async_wait<0>();
    if (kWgmma) wgmma::fence_proxy_async();
    __syncthreads();  // K(t) (and Q) visible to all; every warp is done with V(t-1) and K(t-1)
    load_v(t);
    ptx::cp_async_commit();
    if (t + 1 < num_key_tiles) load_k(t + 1);  // into K(t-1)'s buffer
    ptx::cp_async_commit();

    // S = Q K^T: 16 x 64 per warp, 12 k-steps of 16.
    float s[kBlockN / 8][4];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    if constexpr (kWgmma) {
      // k-step kk: column block kk / 4, 32 bytes (16 bf16) per step inside its 128-byte rows.
      const uint32_t s_qw = s_q + (warp >> 2) * (64 * 128);  // this warpgroup's 64 rows
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kQk / 16; ++kk)
        wgmma::m64n64k16_ss(s, wgmma::smem_desc(s_qw + (kk >> 2) * (kBlockM * 128) + (kk & 3) * 32, 16, 1024),
                           wgmma::smem_desc(s_kt + (kk >> 2) * (kBlockN * 128) + (kk & 3) * 32, 16, 1024));
      wgmma::commit();
      wgmma::wait<0>();
    } else {
#pragma unroll
      for (int kk = 0; kk < kQk / 16; ++kk) {
        uint32_t a[4];
        ptx::ldmatrix_x4(s_q + tile_off<kBlockM>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)), a[0], a[1], a[2],
                         a[3]);
#pragma unroll
        for (int nn = 0; nn < kBlockN / 16; ++nn) {
          uint32_t b0, b1, b2, b3;
          const int k_row = nn * 16 + (lane & 7) + ((lane >> 4) << 3);
          ptx::ldmatrix_x4(s_kt + tile_off<kBlockN>(k_row, kk * 2 + ((lane >> 3) & 1)), b0, b1, b2, b3);
          ptx::mma_m16n8k16_bf16_unordered(s[2 * nn], a, b0, b1);
          ptx::mma_m16n8k16_bf16_unordered(s[2 * nn + 1], a, b2, b3);
        }
      }
    }

    // Mask keys past the range or after the row's position (causal).
    if (key0 + kBlockN > key_stop || key0 + kBlockN - 1 > warp_pos0) {
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + j * 8 + 2 * t4 + (e & 1);
          const int pos = e < 2 ? pos_lo : pos_hi;
          if (key >= key_stop || key > pos) s[j][e] = -INFINITY;
        }
      }
    }

    // Online softmax (base 2, scale folded in).
    float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
    }
    float m_scaled[2], corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      m_scaled[i] = mx[i] == -INFINITY ? 0.0f : mx[i] * scale_log2;  // no (-inf) - (-inf)
      corr[i] = exp2f(m_run[i] * scale_log2 - m_scaled[i]);           // 0 while nothing was seen
      m_run[i] = mx[i];
      l_run[i] *= corr[i];
    }
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      s[j][0] = exp2f(s[j][0] * scale_log2 - m_scaled[0]);
      s[j][1] = exp2f(s[j][1] * scale_log2 - m_scaled[0]);
      s[j][2] = exp2f(s[j][2] * scale_log2 - m_scaled[1]);
      s[j][3] = exp2f(s[j][3] * scale_log2 - m_scaled[1]);
      l_run[0] += s[j][0] + s[j][1];
      l_run[1] += s[j][2] + s[j][3];
    }
#pragma unroll
    for (int j = 0; j < kV / 8; ++j) {
      o[j][0] *= corr[0];
      o[j][1] *= corr[0];
      o[j][2] *= corr[1];
      o[j][3] *= corr[1];
    }

    ptx::cp_async_wait<1>();  // V(t) landed; K(t+1) may be in flight
    if (kWgmma) wgmma::fence_proxy_async();
    __syncthreads();  // V(t) visible to all

    // O += P V: P's C fragments are the A fragments of 4 k-steps of 16 keys.
    uint32_t pa[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      pa[kk][0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
    if constexpr (kWgmma) {
      // V is MN-major for this product: 8-key groups 1024 B apart, the two
      // 64-dim column blocks kBlockN * 128 B apart; k-step kk = 16 keys.
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma::m64n128k16_rs_tb(o, pa[kk], wgmma::smem_desc(s_v + kk * 16 * 128, kBlockN * 128, 1024));
      wgmma::commit();
      wgmma::wait<0>();
    } else {
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
        for (int dn = 0; dn < kV / 16; ++dn) {
          uint32_t b0, b1, b2, b3;
          const int v_row = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
          ptx::ldmatrix_x4_trans(s_v + tile_off<kBlockN>(v_row, dn * 2 + (lane >> 4)), b0, b1, b2, b3);
          ptx::mma_m16n8k16_bf16_unordered(o[2 * dn], pa[kk], b0, b1);
          ptx::mma_m16n8k16_bf16_unordered(o[2 * dn + 1], pa[kk], b2, b3);
        }
      }
    }
  }
  ptx::cp_async_wait<0>();  // nothing may be in flight at exit

  // Epilogue: normalise, merge, store.
  float lse[2], inv_l[2], lse_old[2] = {-INFINITY, -INFINITY};
  const int row_of[2] = {row_lo, row_lo + 8};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
    const bool any = l_run[i] > 0.0f;
    lse[i] = any ? (m_run[i] * scale_log2 + log2f(l_run[i])) * kLn2 : -INFINITY;
    inv_l[i] = any ? 1.0f / l_run[i] : 0.0f;
    if (p.merge && row_of[i] < sq.num_q)
      lse_old[i] = p.lse[static_cast<int64_t>(sq.q_row0 + row_of[i]) * p.num_heads + h];
  }
  __syncwarp();  // every lane of the quad has read the old lse before lane 0 rewrites it
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (row_of[i] >= sq.num_q) continue;
    const int64_t row = sq.q_row0 + row_of[i];
    __nv_bfloat16* out = p.out + row * p.out_stride + h * kV + 2 * t4;
    float w_old = 0.0f, w_new = inv_l[i], lse_new = lse[i];
    if (p.merge) {
      if (lse[i] == -INFINITY) continue;  // nothing new for this row
      const float mx = fmaxf(lse_old[i], lse[i]);
      lse_new = mx + logf(expf(lse_old[i] - mx) + expf(lse[i] - mx));
      w_old = lse_old[i] == -INFINITY ? 0.0f : expf(lse_old[i] - lse_new);
      w_new = expf(lse[i] - lse_new) * inv_l[i];
    }
#pragma unroll
    for (int j = 0; j < kV / 8; ++j) {
      float x0 = o[j][2 * i] * w_new, x1 = o[j][2 * i + 1] * w_new;
      __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + j * 8);
      if (w_old != 0.0f) {
        const float2 old = __bfloat1622float2(*dst);
        x0 += w_old * old.x;
        x1 += w_old * old.y;
      }
      *dst = __floats2bfloat162_rn(x0, x1);
    }
    if (p.lse && t4 == 0) p.lse[row * p.num_heads + h] = lse_new;
  }
}

template <int kWarps>
constexpr size_t smem_bytes() {  // Q, two K buffers, V, + slack to align to 1024
  return (kWarps * 16 * kQk + 2 * kBlockN * kQk + kBlockN * kV) * 2 + 1024;
}

template <int kWarps, bool kWgmma>
cudaError_t launch_variant(const MlaPrefillParams& p, cudaStream_t stream) {
  constexpr size_t kSmem = smem_bytes<kWarps>();
  const cudaError_t attr = cuda_common::once_per_device([] {
    return cudaFuncSetAttribute(mla_prefill_kernel<kWarps, kWgmma>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kSmem));
  });
  if (attr != cudaSuccess) return attr;
  const dim3 grid(static_cast<unsigned>(p.num_work), static_cast<unsigned>(p.num_heads));
  mla_prefill_kernel<kWarps, kWgmma><<<grid, kWarps * 32, kSmem, stream>>>(p);
  return cudaGetLastError();
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace

int mla_prefill_block_m(int64_t tiles_128, int num_heads, int num_sms) {
  return tiles_128 * num_heads >= 2 * static_cast<int64_t>(num_sms) ? 128 : 64;
}

int mla_prefill_ctas_per_sm(int block_m, bool use_wgmma) {
  auto query = [block_m](auto kernel, size_t smem) {
    int n = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block_m * 2, smem) != cudaSuccess)
      return -1;
    return n;
  };
  if (block_m == 128)
    return use_wgmma ? query(mla_prefill_kernel<8, true>, smem_bytes<8>())
                     : query(mla_prefill_kernel<8, false>, smem_bytes<8>());
  return use_wgmma ? query(mla_prefill_kernel<4, true>, smem_bytes<4>())
                   : query(mla_prefill_kernel<4, false>, smem_bytes<4>());
}

cudaError_t launch_mla_prefill(const MlaPrefillParams& p, cudaStream_t stream) {
  if (p.num_work == 0 || p.num_heads == 0) return cudaSuccess;
  if (p.num_heads > 65535 || p.scale <= 0.0f || !(p.block_m == 64 || p.block_m == 128)) return cudaErrorInvalidValue;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.out) || p.q_stride % 8 ||
      p.k_stride % 8 || p.v_stride % 8 || p.out_stride % 2)
    return cudaErrorInvalidValue;
  if ((p.merge && !p.lse) || !p.seqs || !p.work) return cudaErrorInvalidValue;
  if (p.use_wgmma) return p.block_m == 128 ? launch_variant<8, true>(p, stream) : launch_variant<4, true>(p, stream);
  return p.block_m == 128 ? launch_variant<8, false>(p, stream) : launch_variant<4, false>(p, stream);
}

}  // namespace nucleus::kernels
