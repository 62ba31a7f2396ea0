// Split-KV flash decoding for absorbed MLA (see mla_decode.cuh). Two
// attention kernels: the 32-key kernel described here, and the 64-key kernel
// for 16 heads a CTA (MlaDecodeAttnParams::key_tile; its comment further down).
//
// 32-key attention CTA: one query row x one KV split x M m-tiles of 16 heads, 4*M
// warps. Warp (mt, qd) owns heads [16 mt, +16) of the group and
//   - for the scores, the latent dims [144 qd, +144) (9 k-steps): its Q
//     fragments stay in registers for the whole CTA; the four dim-quarter
//     partial score tiles are summed through shared memory;
//   - for the output, o_lat columns [128 qd, +128) (64 f32 accumulators).
// Keys stream through a kStages-deep cp.async ring of 32-key tiles (rows
// padded to 1168 bytes: conflict-free ldmatrix). Each latent row is read
// from memory once per CTA, for all of its heads.
// FP8 cache: the ring holds the raw e4m3 tiles (576-byte rows, twice the
// stages for the same bytes in flight); after a tile lands, the CTA converts
// it exactly to bf16 into one padded tile, which the MMAs read as above.
// fp8_ds_mla cache (kDs): the ring holds raw 656-byte rows (kernels/mla/
// ds_mla_row.h); the conversion multiplies each e4m3 value by its tile's f32
// scale in registers and rounds the product once to bf16 (the rope part is
// bf16 already and copied), so a row costs one bf16 rounding more than the
// per-layer FP8 path, whose scale is factored out exactly.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/common/bulk_copy.cuh"
#include "kernels/common/cuda_common.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/mla/ds_mla_row.h"
#include "kernels/mla/mla_decode.cuh"
#include "kernels/mla/mla_decode_rows.cuh"

#include <algorithm>
#include <cmath>

namespace nucleus::kernels {

namespace {

using mla_decode_detail::cache_row;
using mla_decode_detail::kTileKeys;
using cuda_common::pack_bf16x2;
using mla_decode_detail::row_chunk;
using mla_decode_detail::row_keys;
using mla_decode_detail::row_of;
using mla_decode_detail::split_keys;
using mla_decode_detail::SplitKeys;
using mla_decode_detail::store_output;
constexpr int kRowElems = kMlaDecodeLatent + 8;  // padded smem row: 1168 bytes
constexpr int kTileElems = kTileKeys * kRowElems;
constexpr int kStagesBf16 = 4;
constexpr int kStagesFp8 = 8;                             // same bytes in flight as bf16's 4
constexpr int kStagesDs = 7;                                 // 7 x 32 x 656 B in flight (shared memory bound)
static_assert(kDsMlaRowBytes % 16 == 0 && kDsMlaRopeOffset % 16 == 0, "fp8_ds_mla rows load in 16-byte chunks");
static_assert(kDsMlaLatent == kMlaDecodeLora && kDsMlaRope == kMlaDecodeRope, "fp8_ds_mla row of the fast path");
constexpr int kSpStride = kTileKeys + 8;                  // floats per partial-score row (conflict-free)
constexpr int kChunksPerRow = kMlaDecodeLatent * 2 / 16;  // 72 16-byte chunks per latent row
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t ld_u32(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// kPerSm: CTAs a multiprocessor holds (1, or 2 with a shallower ring: 2
// bf16 tiles, 3 raw FP8 tiles).
__host__ __device__ constexpr int num_stages(bool fp8, bool ds = false, int per_sm = 1) {
  return per_sm == 2 ? (fp8 ? 3 : 2) : ds ? kStagesDs : fp8 ? kStagesFp8 : kStagesBf16;
}
// Bytes of one raw cache row in the ring (FP8 layouts) and of a raw tile.
__host__ __device__ constexpr int raw_row_bytes(bool ds) { return ds ? kDsMlaRowBytes : kMlaDecodeLatent; }
__host__ __device__ constexpr int raw_tile_bytes(bool ds) { return kTileKeys * raw_row_bytes(ds); }

// Shared memory: the ring (bf16 tiles, or raw FP8 tiles then one bf16
// tile), then the partial scores.
template <bool kFp8, bool kDs = false, int kPerSm = 1>
constexpr size_t ring_bytes() {
  return kFp8 ? static_cast<size_t>(num_stages(true, kDs, kPerSm)) * raw_tile_bytes(kDs) +
                    static_cast<size_t>(kTileElems) * 2
              : static_cast<size_t>(num_stages(false, false, kPerSm)) * kTileElems * 2;
}
template <int M, bool kFp8, bool kDs = false, int kPerSm = 1>
constexpr size_t attention_smem_bytes() {
  return ring_bytes<kFp8, kDs, kPerSm>() + static_cast<size_t>(M) * 4 * 16 * kSpStride * 4;
}
static_assert(2 * attention_smem_bytes<1, false, false, 2>() <= 227 * 1024 &&
                  2 * attention_smem_bytes<1, true, true, 2>() <= 227 * 1024,
              "two CTAs of 16 heads fit a multiprocessor");

// Two e4m3 bytes (low byte first) -> bf16x2, exactly (e4m3 -> f16 -> f32 ->
// bf16 loses nothing; NaN stays NaN).
__device__ __forceinline__ uint32_t fp8x2_to_bf16x2(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  __nv_bfloat162 v = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two e4m3 bytes (low byte first) -> f16x2 (the low byte in the low half),
// exactly: one conversion instruction.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// bf16x2 times mul (a power of two) -> f16x2, rounded to nearest.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t v, float mul) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  const __half2 h = __floats2half2_rn(f.x * mul, f.y * mul);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Group g (8 values) of one raw FP8 cache row `raw` -> bf16 at dst + 8 g:
// e4m3 exactly; an fp8_ds_mla row's latent groups times their tile's f32
// scale (one rounding), its 8 rope groups (bf16 already) copied.
template <bool kDs>
__device__ __forceinline__ void convert_row_group(const unsigned char* raw, int g, __nv_bfloat16* dst) {
  if constexpr (kDs) {
    if (g < kDsMlaLatent / 8) {
      const float sc = reinterpret_cast<const float*>(raw + kDsMlaScaleOffset)[g * 8 / kDsMlaTile];
      const uint2 b = *reinterpret_cast<const uint2*>(raw + g * 8);
      const uint32_t w[4] = {b.x, b.x >> 16, b.y, b.y >> 16};
      uint32_t out[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[e] & 0xffffu), __NV_E4M3);
        const float2 f = __half22float2(__half2(h));
        out[e] = pack_bf16x2(f.x * sc, f.y * sc);
      }
      *reinterpret_cast<uint4*>(dst + g * 8) = make_uint4(out[0], out[1], out[2], out[3]);
    } else {
      *reinterpret_cast<uint4*>(dst + g * 8) =
          *reinterpret_cast<const uint4*>(raw + kDsMlaRopeOffset + (g - kDsMlaLatent / 8) * 16);
    }
  } else {
    const uint2 b = *reinterpret_cast<const uint2*>(raw + g * 8);
    *reinterpret_cast<uint4*>(dst + g * 8) = make_uint4(fp8x2_to_bf16x2(b.x), fp8x2_to_bf16x2(b.x >> 16),
                                                        fp8x2_to_bf16x2(b.y), fp8x2_to_bf16x2(b.y >> 16));
  }
}

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kThreadsPerRow = kThreads / kTileKeys;           // loader: 8 threads per key row
constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerRow;  // 9
static_assert(kChunksPerRow % kThreadsPerRow == 0, "loader split");

// M m-tiles of 16 heads; 8 warps. Warp w: m-tile mt = w / (8 / M); for the
// scores dim quarter qd = w % 4 and keys [16 M kh, +16 M) of the tile
// (kh = (w % (8 / M)) / 4); for the output columns [64 M c, +64 M)
// (c = w % (8 / M)). kFp8: the cache holds e4m3 bytes; kDs (with kFp8):
// fp8_ds_mla rows (see the file comment).
template <int M, bool kFp8, bool kDs = false, int kPerSm = 1>
__global__ void __launch_bounds__(kThreads, kPerSm) mla_decode_attention_kernel(const MlaDecodeAttnParams p) {
  static_assert(kFp8 || !kDs, "an fp8_ds_mla ring is a raw FP8 ring");
  constexpr int kWarpsPerMt = kWarps / M;  // 8 or 4
  constexpr int kNtS = 2 * M;              // score n-tiles (8 keys) per warp
  constexpr int kNtO = 8 * M;              // output n-tiles (8 columns) per warp
  constexpr int kStages = num_stages(kFp8, kDs, kPerSm);
  constexpr int kRawRow = raw_row_bytes(kDs), kRawTile = raw_tile_bytes(kDs), kRawChunks = kRawRow / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // bf16: the ring [kStages][32][kRowElems]; FP8: the raw ring [kStages][32][576 B], then one bf16 tile.
  __nv_bfloat16* kv_smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  unsigned char* raw_smem = smem_raw;
  __nv_bfloat16* conv_tile =
      reinterpret_cast<__nv_bfloat16*>(smem_raw + static_cast<size_t>(kStages) * kRawTile);
  float* sp = reinterpret_cast<float*>(smem_raw + ring_bytes<kFp8, kDs, kPerSm>());  // [M][4][16][kSpStride]

  const int H = p.num_heads;
  const int group = blockIdx.x, split = blockIdx.y;
  const int64_t i = blockIdx.z;
  const SplitKeys sk = split_keys<kTileKeys>(p, i, split);
  if (sk.num_tiles == 0) return;  // this row needs fewer splits
  const int k_begin = sk.k_begin, k_end = sk.k_end, num_tiles = sk.num_tiles;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int mt = warp / kWarpsPerMt, wi = warp % kWarpsPerMt, qd = wi & 3, kh = wi >> 2;
  const int h_lo = group * 16 * M + mt * 16 + (lane >> 2), h_hi = h_lo + 8;

  // Loader: thread copies 16-byte chunks ld_part + 8 j of key row ld_row of a
  // tile (bf16: 72 chunks a row, 9 each; FP8: 36 a row, 4 or 5 each).
  const int ld_row = tid / kThreadsPerRow, ld_part = tid % kThreadsPerRow;
  constexpr int kRowBytes = kFp8 ? kRawRow : kMlaDecodeLatent * 2;
  const auto* cache_bytes = static_cast<const unsigned char*>(p.cache);
  auto row_src = [&](int t) -> const unsigned char* {  // this thread's row of tile t, or null past the end
    const int key = k_begin + t * kTileKeys + ld_row;
    return key < k_end ? cache_row(p, sk.table, key, kRowBytes) : nullptr;
  };
  auto load_tile = [&](const unsigned char* src, int stage) {
    const bool valid = src != nullptr;
    const unsigned char* s0 = valid ? src + ld_part * 16 : cache_bytes;
    if constexpr (kFp8) {
      const uint32_t dst = ptx::smem_u32(raw_smem + stage * kRawTile + ld_row * kRawRow + ld_part * 16);
#pragma unroll
      for (int j = 0; j < (kRawChunks + kThreadsPerRow - 1) / kThreadsPerRow; ++j)
        if (ld_part + j * kThreadsPerRow < kRawChunks)
          ptx::cp_async_16(dst + j * kThreadsPerRow * 16, valid ? s0 + j * kThreadsPerRow * 16 : s0, valid ? 16 : 0);
    } else {
      const uint32_t dst = ptx::smem_u32(kv_smem + stage * kTileElems + ld_row * kRowElems + ld_part * 8);
#pragma unroll
      for (int j = 0; j < kChunksPerThread; ++j)
        ptx::cp_async_16(dst + j * kThreadsPerRow * 16, valid ? s0 + j * kThreadsPerRow * 16 : s0, valid ? 16 : 0);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) load_tile(row_src(s), s);
    ptx::cp_async_commit();
  }
  const unsigned char* next_src = kStages - 1 < num_tiles ? row_src(kStages - 1) : nullptr;
  // As a programmatic dependent (PDL) of the q absorption: the cache rows
  // (written before it) are on their way; q_full is read only after it has
  // finished. The output kernel after this one may start its weight loads.
  pdl::wait_for_inputs();
  pdl::launch_dependents();

  // Q fragments (A operand, 16 heads x 16 dims per k-step) of this warp's dim quarter.
  uint32_t qf[9][4];
  {
    const __nv_bfloat16* qb = p.q_full + i * H * kMlaDecodeLatent;
    const bool lo_ok = h_lo < H, hi_ok = h_hi < H;
#pragma unroll
    for (int ks = 0; ks < 9; ++ks) {
      const int d0 = (qd * 9 + ks) * 16 + (lane & 3) * 2;
      qf[ks][0] = lo_ok ? ld_u32(qb + h_lo * kMlaDecodeLatent + d0) : 0u;
      qf[ks][1] = hi_ok ? ld_u32(qb + h_hi * kMlaDecodeLatent + d0) : 0u;
      qf[ks][2] = lo_ok ? ld_u32(qb + h_lo * kMlaDecodeLatent + d0 + 8) : 0u;
      qf[ks][3] = hi_ok ? ld_u32(qb + h_hi * kMlaDecodeLatent + d0 + 8) : 0u;
    }
  }

  float o[kNtO][4];
#pragma unroll
  for (int n = 0; n < kNtO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
  // An FP8 row is stored * k_scale: the factor goes on the scores and the output
  // (an fp8_ds_mla row's tile scales are applied in the conversion instead).
  const float k_scale = kFp8 && !kDs ? p.k_scale : 1.0f;
  const float scale_log2 = p.scale * k_scale * kLog2e;
  float* sp_mine = sp + (mt * 4 + qd) * 16 * kSpStride + kh * 16 * M;
  const float* sp_tile = sp + mt * 4 * 16 * kSpStride;
  const int r_lo = lane >> 2, c0 = (lane & 3) * 2;

  for (int t = 0; t < num_tiles; ++t) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int nt = t + kStages - 1;
      if (nt < num_tiles) {
        load_tile(next_src, nt % kStages);
        next_src = nt + 1 < num_tiles ? row_src(nt + 1) : nullptr;  // its latency hides behind this tile
      }
      ptx::cp_async_commit();
    }
    const __nv_bfloat16* kv;
    if constexpr (kFp8) {
      // The landed raw tile -> the bf16 tile, 8 values a step (convert_row_group:
      // e4m3 exactly, or an fp8_ds_mla row's latent times its tiles' scales and
      // its rope copied).
      const unsigned char* raw = raw_smem + (t % kStages) * kRawTile + ld_row * kRawRow;
      __nv_bfloat16* dst = conv_tile + ld_row * kRowElems;
#pragma unroll
      for (int j = 0; j < kMlaDecodeLatent / 8 / kThreadsPerRow; ++j)
        convert_row_group<kDs>(raw, ld_part + j * kThreadsPerRow, dst);
      __syncthreads();
      kv = conv_tile;
    } else {
      kv = kv_smem + (t % kStages) * kTileElems;
    }

    // Partial scores over this warp's 144 dims and 16 M keys.
    {
      float s[kNtS][4];
#pragma unroll
      for (int j = 0; j < kNtS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < 9; ++ks) {
        const int kd = (qd * 9 + ks) * 16 + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int jp = 0; jp < kNtS / 2; ++jp) {
          const int key = kh * 16 * M + (2 * jp + (lane >> 4)) * 8 + (lane & 7);
          uint32_t b0, b1, b2, b3;
          ptx::ldmatrix_x4(ptx::smem_u32(kv + key * kRowElems + kd), b0, b1, b2, b3);
          ptx::mma_m16n8k16_bf16(s[2 * jp], qf[ks], b0, b1);
          ptx::mma_m16n8k16_bf16(s[2 * jp + 1], qf[ks], b2, b3);
        }
      }
#pragma unroll
      for (int j = 0; j < kNtS; ++j) {
        *reinterpret_cast<float2*>(sp_mine + r_lo * kSpStride + j * 8 + c0) = make_float2(s[j][0], s[j][1]);
        *reinterpret_cast<float2*>(sp_mine + (r_lo + 8) * kSpStride + j * 8 + c0) = make_float2(s[j][2], s[j][3]);
      }
    }
    __syncthreads();
    // Full scores of the m-tile's 32 keys (sum of the four quarters), log2 units, masked.
    float s[4][4];
    const int key_base = k_begin + t * kTileKeys;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 lo = make_float2(0.f, 0.f), hi = make_float2(0.f, 0.f);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float* b = sp_tile + q * 16 * kSpStride;
        const float2 a = *reinterpret_cast<const float2*>(b + r_lo * kSpStride + j * 8 + c0);
        const float2 c = *reinterpret_cast<const float2*>(b + (r_lo + 8) * kSpStride + j * 8 + c0);
        lo.x += a.x;
        lo.y += a.y;
        hi.x += c.x;
        hi.y += c.y;
      }
      const bool v0 = key_base + j * 8 + c0 < k_end, v1 = key_base + j * 8 + c0 + 1 < k_end;
      s[j][0] = v0 ? lo.x * scale_log2 : -INFINITY;
      s[j][1] = v1 ? lo.y * scale_log2 : -INFINITY;
      s[j][2] = v0 ? hi.x * scale_log2 : -INFINITY;
      s[j][3] = v1 ? hi.y * scale_log2 : -INFINITY;
    }
    // Online softmax (rows r_lo and r_lo + 8; a row's 32 keys sit in 4 lanes).
    float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    const float corr_lo = exp2f(m_lo - mx_lo), corr_hi = exp2f(m_hi - mx_hi);
    m_lo = mx_lo;
    m_hi = mx_hi;
    float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s[j][0] = exp2f(s[j][0] - mx_lo);
      s[j][1] = exp2f(s[j][1] - mx_lo);
      s[j][2] = exp2f(s[j][2] - mx_hi);
      s[j][3] = exp2f(s[j][3] - mx_hi);
      sum_lo += s[j][0] + s[j][1];
      sum_hi += s[j][2] + s[j][3];
    }
    l_lo = l_lo * corr_lo + sum_lo;
    l_hi = l_hi * corr_hi + sum_hi;
#pragma unroll
    for (int n = 0; n < kNtO; ++n) {
      o[n][0] *= corr_lo;
      o[n][1] *= corr_lo;
      o[n][2] *= corr_hi;
      o[n][3] *= corr_hi;
    }
    // o[:, 64 M wi : +64 M] += P (16 x 32) . V (32 x 64 M).
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const int key = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
      for (int np = 0; np < kNtO / 2; ++np) {
        const int col = wi * 64 * M + (2 * np + (lane >> 4)) * 8;
        uint32_t b0, b1, b2, b3;
        ptx::ldmatrix_x4_trans(ptx::smem_u32(kv + key * kRowElems + col), b0, b1, b2, b3);
        ptx::mma_m16n8k16_bf16(o[2 * np], a, b0, b1);
        ptx::mma_m16n8k16_bf16(o[2 * np + 1], a, b2, b3);
      }
    }
  }
  ptx::cp_async_wait<0>();

  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  const float inv_lo = k_scale / l_lo, inv_hi = k_scale / l_hi;
  store_output(p, o, i, split, h_lo, h_hi, wi * 64 * M + (lane & 3) * 2, inv_lo, inv_hi, wi == 0 && (lane & 3) == 0,
               m_lo + log2f(l_lo), m_hi + log2f(l_hi));
}

// ---------------------------------------------------------------------------
// The 64-key attention kernel (MlaDecodeAttnParams::key_tile = 64): one query
// row x one KV split x 16 heads, 8 warps. Warp w
//   - scores keys [8 w, +8) of each 64-key tile over all 576 dims: its Q
//     fragments (16 heads x 576, 144 registers) stay in registers, two
//     independent accumulator chains; no partial scores cross warps;
//   - loads (cp.async) and, for FP8 caches, converts exactly those 8 rows;
//   - shares the tile's softmax through shared memory: per-head maxima of its
//     8 keys, then P (bf16) and per-head sums of its 8 keys;
//   - accumulates o_lat columns [64 w, +64) over the tile's 64 keys (P . V).
// Three barriers a 64-key tile (tile landed, maxima, P), against four a 64
// keys and a softmax redone by every warp in the 32-key kernel.
// FP8 rows, two ways (MlaDecodeAttnParams::fp8_register_convert): each warp
// converts its 8 rows to bf16 into one shared tile that bf16 MMAs read (the
// tile can be refilled only once every warp is done with it), or (kReg) the
// MMAs build their fragments from the raw ring in registers (f16 MMAs; the
// k-step dims and P . V keys permuted alike on both operands; q in f16 times
// a per-head power of two; fp8_ds_mla tile scales on the partial scores and,
// over a running per-warp power of two, on P).
constexpr int kWideKeys = kMlaDecodeWideTileKeys;
constexpr int kWideTileElems = kWideKeys * kRowElems;
constexpr int kWideThreadsPerRow = kThreads / kWideKeys;  // loader: 4 threads a key row, warp w: rows [8 w, +8)
constexpr int kPStride = kWideKeys + 8;                    // bf16 per P row (144 bytes: conflict-free ldmatrix)

// A row in the ring of the register-conversion path (kReg): e4m3 576 bytes
// padded to 608 (24 words mod 32), fp8_ds_mla 656 padded to 672 (8 mod 32), so
// that the 8-byte fragment loads of 4 consecutive rows (a half warp) meet 32
// distinct banks.
__host__ __device__ constexpr int reg_row_bytes(bool ds) { return ds ? kDsMlaRowBytes + 16 : kMlaDecodeLatent + 32; }
static_assert(reg_row_bytes(false) / 4 % 32 == 24 && reg_row_bytes(true) / 4 % 32 == 8, "conflict-free rows");

// Ring depth: as many tiles as fit beside the bf16 (conversion) tile, P and
// the reductions; the register-conversion path has no conversion tile.
__host__ __device__ constexpr int wide_stages(bool fp8, bool ds, bool reg = false) {
  return reg ? 5 : ds ? 3 : fp8 ? 4 : 3;
}
template <bool kFp8, bool kDs, bool kReg = false>
constexpr size_t wide_smem_bytes() {
  const size_t raw_tile = static_cast<size_t>(kWideKeys) * (kReg ? reg_row_bytes(kDs) : raw_row_bytes(kDs));
  const size_t ring = kReg   ? wide_stages(true, kDs, true) * raw_tile
                      : kFp8 ? wide_stages(true, kDs) * raw_tile + static_cast<size_t>(kWideTileElems) * 2
                             : static_cast<size_t>(wide_stages(false, false)) * kWideTileElems * 2;
  return ring + 16 * kPStride * 2 + 2 * 16 * kWarps * 4 + wide_stages(kFp8, kDs, kReg) * 8;  // + the stage mbarriers
}
static_assert(wide_smem_bytes<false, false>() <= 227 * 1024 && wide_smem_bytes<true, false>() <= 227 * 1024 &&
                  wide_smem_bytes<true, true>() <= 227 * 1024 && wide_smem_bytes<true, false, true>() <= 227 * 1024 &&
                  wide_smem_bytes<true, true, true>() <= 227 * 1024,
              "64-key tiles fit one CTA a multiprocessor");

// store_output for the register-conversion path's o fragments: o[j][0] and
// o[j][1] are o_lat columns col0 + j and col0 + 8 + j of head h_lo (o[j][2],
// o[j][3] of h_hi), so each head's 16 columns [col0, +16) leave whole.
__device__ __forceinline__ void store_output16(const MlaDecodeAttnParams& p, const float (&o)[8][4], int64_t i,
                                               int split, int h_lo, int h_hi, int col0, float inv_lo, float inv_hi,
                                               bool write_lse, float lse_lo, float lse_hi) {
  const int H = p.num_heads;
  const int heads[2] = {h_lo, h_hi};
  const float inv[2] = {inv_lo, inv_hi};
  const bool whole = p.num_splits == 1;
  const int64_t base = (i * p.num_splits + split) * H;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (heads[r] >= H) continue;
    float v[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = o[j][2 * r] * inv[r];
      v[8 + j] = o[j][2 * r + 1] * inv[r];
    }
    if (whole) {
      uint4* ob = reinterpret_cast<uint4*>(p.o_lat + (i * H + heads[r]) * kMlaDecodeLora + col0);
      ob[0] = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
      ob[1] = make_uint4(pack_bf16x2(v[8], v[9]), pack_bf16x2(v[10], v[11]), pack_bf16x2(v[12], v[13]),
                         pack_bf16x2(v[14], v[15]));
    } else {
      float4* ob = reinterpret_cast<float4*>(p.part_o + (base + heads[r]) * kMlaDecodeLora + col0);
#pragma unroll
      for (int c = 0; c < 4; ++c) ob[c] = make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
    }
  }
  if (!whole && write_lse) {
    if (h_lo < H) p.part_lse[base + h_lo] = lse_lo;
    if (h_hi < H) p.part_lse[base + h_hi] = lse_hi;
  }
}

template <bool kFp8, bool kDs, bool kBulk, bool kReg = false>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_attention64_kernel(const MlaDecodeAttnParams p) {
  static_assert(kFp8 || !kDs, "an fp8_ds_mla ring is a raw FP8 ring");
  static_assert(!kReg || kFp8, "register conversion: FP8 rows");
  constexpr int kRegRowBytes = reg_row_bytes(kDs);
  constexpr int kStages = wide_stages(kFp8, kDs, kReg);
  constexpr int kRawRow = raw_row_bytes(kDs), kRawChunks = kRawRow / 16;
  constexpr int kRawTile = kWideKeys * (kReg ? kRegRowBytes : kRawRow);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* kv_smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  unsigned char* raw_smem = smem_raw;
  __nv_bfloat16* conv_tile = reinterpret_cast<__nv_bfloat16*>(smem_raw + static_cast<size_t>(kStages) * kRawTile);
  const size_t ring = kReg   ? static_cast<size_t>(kStages) * kRawTile
                      : kFp8 ? static_cast<size_t>(kStages) * kRawTile + static_cast<size_t>(kWideTileElems) * 2
                             : static_cast<size_t>(kStages) * kWideTileElems * 2;
  __nv_bfloat16* p_smem = reinterpret_cast<__nv_bfloat16*>(smem_raw + ring);               // [16][kPStride]
  float* red_max = reinterpret_cast<float*>(smem_raw + ring + 16 * kPStride * 2);          // [16 heads][8 warps]
  float* red_sum = red_max + 16 * kWarps;                                                  // [16 heads][8 warps]
  uint64_t* stage_bars = reinterpret_cast<uint64_t*>(red_sum + 16 * kWarps);              // [kStages] (kBulk)

  const int H = p.num_heads;
  const int group = blockIdx.x, split = blockIdx.y;
  const int64_t i = blockIdx.z;
  const SplitKeys sk = split_keys<kWideKeys>(p, i, split);
  if (sk.num_tiles == 0) return;  // this row needs fewer splits
  const int k_begin = sk.k_begin, k_end = sk.k_end, num_tiles = sk.num_tiles;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r_lo = lane >> 2, c0 = (lane & 3) * 2;
  const int h_lo = group * 16 + r_lo, h_hi = h_lo + 8;

  // Loader. A warp loads the 8 rows it scores, rows [8 warp, +8) of a tile.
  //  - cp.async (!kBulk): thread copies 16-byte chunks ld_part + 4 j of row
  //    ld_row = 8 warp + lane / 4; completion by cp.async groups.
  //  - bulk (kBulk): lane l < 8 copies row 8 warp + l whole with one
  //    cp.async.bulk; lane 0 announces the warp's bytes on the stage's
  //    mbarrier (8 arrivals a phase, one a warp); rows past the split's end
  //    are zeroed by the warp (their scores are masked, and P . V must not
  //    meet stale NaN bits).
  const int ld_row = tid / kWideThreadsPerRow, ld_part = tid % kWideThreadsPerRow;
  const int src_row = kBulk ? warp * 8 + (lane & 7) : ld_row;
  constexpr int kRowBytes = kFp8 ? kRawRow : kMlaDecodeLatent * 2;
  constexpr int kDstRowBytes = kReg ? kRegRowBytes : kFp8 ? kRawRow : kRowElems * 2;
  constexpr int kChunks = kFp8 ? kRawChunks : kChunksPerRow;
  constexpr int kLoads = (kChunks + kWideThreadsPerRow - 1) / kWideThreadsPerRow;
  const auto* cache_bytes = static_cast<const unsigned char*>(p.cache);
  auto row_src = [&](int t) -> const unsigned char* {
    const int key = k_begin + t * kWideKeys + src_row;
    return key < k_end ? cache_row(p, sk.table, key, kRowBytes) : nullptr;
  };
  auto stage_bar = [&](int stage) { return ptx::smem_u32(stage_bars + stage); };
  auto load_tile = [&](const unsigned char* src, int t, int stage) {
    unsigned char* stage_base =
        kFp8 ? raw_smem + stage * kRawTile : reinterpret_cast<unsigned char*>(kv_smem + stage * kWideTileElems);
    if constexpr (kBulk) {
      const int n_valid = max(0, min(8, k_end - (k_begin + t * kWideKeys + warp * 8)));
      if (lane == 0) ptx::mbarrier_arrive_expect_tx(stage_bar(stage), static_cast<uint32_t>(n_valid * kRowBytes));
      if (lane < n_valid) {
        ptx::fence_proxy_async();  // earlier generic reads / writes of this stage before the copy engine's writes
        ptx::bulk_copy_g2s(ptx::smem_u32(stage_base + src_row * kDstRowBytes), src, kRowBytes, stage_bar(stage),
                           ptx::l2_evict_first_policy());
      }
      if (n_valid < 8)
        for (int c = lane; c < (8 - n_valid) * (kRowBytes / 16); c += 32)
          *reinterpret_cast<uint4*>(stage_base + (warp * 8 + n_valid + c / (kRowBytes / 16)) * kDstRowBytes +
                                    (c % (kRowBytes / 16)) * 16) = make_uint4(0u, 0u, 0u, 0u);
    } else {
      const bool valid = src != nullptr;
      const unsigned char* s0 = valid ? src + ld_part * 16 : cache_bytes;
      const uint32_t dst = ptx::smem_u32(stage_base + ld_row * kDstRowBytes + ld_part * 16);
#pragma unroll
      for (int j = 0; j < kLoads; ++j)
        if (kChunks % kWideThreadsPerRow == 0 || ld_part + j * kWideThreadsPerRow < kChunks)
          ptx::cp_async_16(dst + j * kWideThreadsPerRow * 16, valid ? s0 + j * kWideThreadsPerRow * 16 : s0,
                           valid ? 16 : 0);
    }
  };
  if constexpr (kBulk) {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(stage_bar(s), kWarps);
      ptx::fence_mbarrier_init();
    }
    __syncthreads();
  }

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) load_tile(row_src(s), s, s);
    if constexpr (!kBulk) ptx::cp_async_commit();
  }
  const unsigned char* next_src = kStages - 1 < num_tiles ? row_src(kStages - 1) : nullptr;
  pdl::wait_for_inputs();  // as the 32-key kernel: q_full is read after the absorption finished
  pdl::launch_dependents();

  // Q fragments (A operand, 16 heads x 16 dims) of all 36 k-steps: q_full's
  // 16 x 576 block staged in shared memory with 16-byte loads (in the ring
  // stage the prologue left empty, or the FP8 conversion tile), then ldmatrix.
  uint32_t qf[36][4];
  float pow2_lo = 1.0f, pow2_hi = 1.0f;  // kReg: the scores' factors 2^e undoing q's 2^-e (heads h_lo, h_hi)
  if constexpr (kReg) {
    // f16 fragments, read from q_full directly: a k-step pair (2 c, 2 c + 1)
    // takes dims [32 c, +32); lane (g, qd) holds dims 32 c + 8 qd + [0, 8)
    // of heads g and g + 8, dims +0..3 in k-step 2 c and +4..7 in 2 c + 1
    // (a permutation of each k-step's dims, the same one the key fragments
    // use). Each head's row, held by the 4 lanes of a quad, is scaled by
    // 2^-e, e from its largest |q|, so that it sits below 2^15: no f16
    // overflow, full f16 precision for its large values.
    const __nv_bfloat16* qb = p.q_full + (i * H + group * 16) * kMlaDecodeLatent;
    const int heads_here = min(16, H - group * 16);
    const int qd = lane & 3;
    const bool lo_ok = r_lo < heads_here, hi_ok = r_lo + 8 < heads_here;
    const __nv_bfloat16* q_lo = qb + r_lo * kMlaDecodeLatent + qd * 8;
    const __nv_bfloat16* q_hi = q_lo + 8 * kMlaDecodeLatent;
    __nv_bfloat162 amax_lo = __float2bfloat162_rn(0.0f), amax_hi = amax_lo;
    auto abs2 = [](uint32_t w) {
      const uint32_t a = w & 0x7fff7fffu;
      return *reinterpret_cast<const __nv_bfloat162*>(&a);
    };
#pragma unroll
    for (int c = 0; c < 18; ++c) {  // the bf16 bits first
      const uint4 a = lo_ok ? *reinterpret_cast<const uint4*>(q_lo + 32 * c) : make_uint4(0u, 0u, 0u, 0u);
      const uint4 b = hi_ok ? *reinterpret_cast<const uint4*>(q_hi + 32 * c) : make_uint4(0u, 0u, 0u, 0u);
      qf[2 * c][0] = a.x;
      qf[2 * c][1] = b.x;
      qf[2 * c][2] = a.y;
      qf[2 * c][3] = b.y;
      qf[2 * c + 1][0] = a.z;
      qf[2 * c + 1][1] = b.z;
      qf[2 * c + 1][2] = a.w;
      qf[2 * c + 1][3] = b.w;
      if (!kDs || c < 16) {  // fp8_ds_mla: the rope dims stay bf16 (bf16 MMAs on bf16 rows)
        amax_lo = __hmax2(__hmax2(amax_lo, abs2(a.x)), __hmax2(abs2(a.y), __hmax2(abs2(a.z), abs2(a.w))));
        amax_hi = __hmax2(__hmax2(amax_hi, abs2(b.x)), __hmax2(abs2(b.y), __hmax2(abs2(b.z), abs2(b.w))));
      }
    }
    float m_lo = fmaxf(__low2float(amax_lo), __high2float(amax_lo));
    float m_hi = fmaxf(__low2float(amax_hi), __high2float(amax_hi));
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {  // the quad holds the head's whole row
      m_lo = fmaxf(m_lo, __shfl_xor_sync(0xffffffffu, m_lo, off));
      m_hi = fmaxf(m_hi, __shfl_xor_sync(0xffffffffu, m_hi, off));
    }
    auto exponent = [](float amax) {
      int x = 0;
      if (amax > 0.0f && isfinite(amax)) frexpf(amax, &x);  // amax < 2^x
      return amax > 0.0f && isfinite(amax) ? max(-100, x - 15) : 0;
    };
    const int e_lo = exponent(m_lo), e_hi = exponent(m_hi);
    const float mul_lo = ldexpf(1.0f, -e_lo), mul_hi = ldexpf(1.0f, -e_hi);
    pow2_lo = ldexpf(1.0f, e_lo);
    pow2_hi = ldexpf(1.0f, e_hi);
#pragma unroll
    for (int ks = 0; ks < (kDs ? 32 : 36); ++ks) {
      qf[ks][0] = bf16x2_to_f16x2(qf[ks][0], mul_lo);
      qf[ks][1] = bf16x2_to_f16x2(qf[ks][1], mul_hi);
      qf[ks][2] = bf16x2_to_f16x2(qf[ks][2], mul_lo);
      qf[ks][3] = bf16x2_to_f16x2(qf[ks][3], mul_hi);
    }
  } else {
    __nv_bfloat16* q_stage = kFp8 ? conv_tile : kv_smem + (kStages - 1) * kWideTileElems;  // [16][kRowElems]
    const __nv_bfloat16* qb = p.q_full + (i * H + group * 16) * kMlaDecodeLatent;
    const int heads_here = min(16, H - group * 16);
    for (int c = tid; c < 16 * kChunksPerRow; c += kThreads) {
      const int h = c / kChunksPerRow, part = c % kChunksPerRow;
      const uint4 v = h < heads_here ? *reinterpret_cast<const uint4*>(qb + h * kMlaDecodeLatent + part * 8)
                                     : make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(q_stage + h * kRowElems + part * 8) = v;
    }
    __syncthreads();
    const uint32_t a_addr = ptx::smem_u32(q_stage + (lane & 15) * kRowElems + (lane >> 4) * 8);
#pragma unroll
    for (int ks = 0; ks < 36; ++ks)
      ptx::ldmatrix_x4(a_addr + ks * 16 * 2, qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3]);
    // The first iteration's barrier orders these reads before the stage (or
    // the conversion tile) is written again.
  }

  float o[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
  const float k_scale = kFp8 && !kDs ? p.k_scale : 1.0f;
  // (fp8_ds_mla: 2^e multiplies the latent part of a score only, inside the score loop.)
  const float scale_lo = p.scale * k_scale * kLog2e * (kDs ? 1.0f : pow2_lo);
  const float scale_hi = p.scale * k_scale * kLog2e * (kDs ? 1.0f : pow2_hi);
  int ds_exp = -200;  // kReg && kDs: this warp's o is in units of 2^ds_exp (the largest tile scale seen, rounded up)

  for (int t = 0; t < num_tiles; ++t) {
    if constexpr (kBulk)
      ptx::mbarrier_wait_parity(stage_bar(t % kStages), static_cast<uint32_t>(t / kStages) & 1u);
    else
      ptx::cp_async_wait<kStages - 2>();
    __syncthreads();  // tile t landed; every warp is done with tile t - 1 (ring stage, P, sums)
    {
      const int nt = t + kStages - 1;
      if (nt < num_tiles) {
        load_tile(next_src, nt, nt % kStages);
        next_src = nt + 1 < num_tiles ? row_src(nt + 1) : nullptr;
      }
      if constexpr (!kBulk) ptx::cp_async_commit();
    }
    const __nv_bfloat16* kv = nullptr;
    const unsigned char* raw_tile = raw_smem + (t % kStages) * kRawTile;  // kReg: the e4m3 rows, read as they are
    if constexpr (kFp8 && !kReg) {
      // This warp's 8 raw rows -> the bf16 tile (read by every warp only after the next barrier).
      const unsigned char* raw = raw_tile + ld_row * kRawRow;
      __nv_bfloat16* dst = conv_tile + ld_row * kRowElems;
#pragma unroll
      for (int j = 0; j < kMlaDecodeLatent / 8 / kWideThreadsPerRow; ++j)
        convert_row_group<kDs>(raw, ld_part + j * kWideThreadsPerRow, dst);
      __syncwarp();  // the warp's own rows, converted, before its score MMAs read them
      kv = conv_tile;
    } else if constexpr (!kFp8) {
      kv = kv_smem + (t % kStages) * kWideTileElems;
    }

    // Scores of the warp's 8 keys (16 heads x 8 keys), two chains over the 36 k-steps.
    float s[4];
    {
      float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (kReg && kDs) {
        // Key warp 8 + g; latent tile b (dims [128 b, +128)) in its own sums,
        // times the key's tile scale after; the rope dims (bf16 rows) with
        // bf16 MMAs on q's bf16 fragments.
        const unsigned char* krow = raw_tile + (warp * 8 + r_lo) * kRegRowBytes;
        float acc[kDsMlaScales][4] = {};
#pragma unroll
        for (int b = 0; b < kDsMlaScales; ++b)
#pragma unroll
          for (int c = 4 * b; c < 4 * b + 4; ++c) {
            const uint2 v = *reinterpret_cast<const uint2*>(krow + 32 * c + (lane & 3) * 8);
            ptx::mma_m16n8k16_f16_unordered(acc[b], qf[2 * c], e4m3x2_to_f16x2(v.x), e4m3x2_to_f16x2(v.x >> 16));
            ptx::mma_m16n8k16_f16_unordered(acc[b], qf[2 * c + 1], e4m3x2_to_f16x2(v.y), e4m3x2_to_f16x2(v.y >> 16));
          }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint4 v = *reinterpret_cast<const uint4*>(krow + kDsMlaRopeOffset + 64 * c + (lane & 3) * 16);
          ptx::mma_m16n8k16_bf16_unordered(sb, qf[32 + 2 * c], v.x, v.y);
          ptx::mma_m16n8k16_bf16_unordered(sb, qf[33 + 2 * c], v.z, v.w);
        }
        // The tile scales of keys warp 8 + c0 (columns 0, 2 of the sums) and + 1 (1, 3).
        const float4 s0 = *reinterpret_cast<const float4*>(raw_tile + (warp * 8 + c0) * kRegRowBytes + kDsMlaScaleOffset);
        const float4 s1 =
            *reinterpret_cast<const float4*>(raw_tile + (warp * 8 + c0 + 1) * kRegRowBytes + kDsMlaScaleOffset);
        const float sc0[4] = {s0.x, s0.y, s0.z, s0.w}, sc1[4] = {s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int b = 0; b < kDsMlaScales; ++b) {
          sa[0] += acc[b][0] * sc0[b];
          sa[1] += acc[b][1] * sc1[b];
          sa[2] += acc[b][2] * sc0[b];
          sa[3] += acc[b][3] * sc1[b];
        }
        sa[0] *= pow2_lo;
        sa[1] *= pow2_lo;
        sa[2] *= pow2_hi;
        sa[3] *= pow2_hi;
      } else if constexpr (kReg) {
        // Key warp 8 + g (the B fragment's column), dims 32 c + 8 qd + [0, 8): one 8-byte load a k-step pair.
        const unsigned char* krow = raw_tile + (warp * 8 + r_lo) * kRegRowBytes + (lane & 3) * 8;
#pragma unroll
        for (int c = 0; c < 18; ++c) {
          const uint2 v = *reinterpret_cast<const uint2*>(krow + 32 * c);
          ptx::mma_m16n8k16_f16_unordered(sa, qf[2 * c], e4m3x2_to_f16x2(v.x), e4m3x2_to_f16x2(v.x >> 16));
          ptx::mma_m16n8k16_f16_unordered(sb, qf[2 * c + 1], e4m3x2_to_f16x2(v.y), e4m3x2_to_f16x2(v.y >> 16));
        }
      } else {
        const uint32_t b_addr = ptx::smem_u32(kv + (warp * 8 + (lane & 7)) * kRowElems + (lane >> 3) * 8);
#pragma unroll
        for (int ks = 0; ks < 36; ks += 2) {
          uint32_t b0, b1, b2, b3;
          ptx::ldmatrix_x4(b_addr + ks * 16 * 2, b0, b1, b2, b3);
          ptx::mma_m16n8k16_bf16_unordered(sa, qf[ks], b0, b1);
          ptx::mma_m16n8k16_bf16_unordered(sb, qf[ks + 1], b2, b3);
        }
      }
      const int key = k_begin + t * kWideKeys + warp * 8 + c0;
      const bool v0 = key < k_end, v1 = key + 1 < k_end;
      s[0] = v0 ? (sa[0] + sb[0]) * scale_lo : -INFINITY;
      s[1] = v1 ? (sa[1] + sb[1]) * scale_lo : -INFINITY;
      s[2] = v0 ? (sa[2] + sb[2]) * scale_hi : -INFINITY;
      s[3] = v1 ? (sa[3] + sb[3]) * scale_hi : -INFINITY;
    }
    // The tile's per-head maxima: the warp's 8 keys sit in 4 lanes a head.
    {
      float mx_lo = fmaxf(s[0], s[1]), mx_hi = fmaxf(s[2], s[3]);
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      if ((lane & 3) == 0) {
        red_max[r_lo * kWarps + warp] = mx_lo;
        red_max[(r_lo + 8) * kWarps + warp] = mx_hi;
      }
    }
    __syncthreads();
    float mx_lo = m_lo, mx_hi = m_hi;
    {
      const float4* a = reinterpret_cast<const float4*>(red_max + r_lo * kWarps);
      const float4* b = reinterpret_cast<const float4*>(red_max + (r_lo + 8) * kWarps);
      const float4 a0 = a[0], a1 = a[1], b0 = b[0], b1 = b[1];
      mx_lo = fmaxf(mx_lo, fmaxf(fmaxf(fmaxf(a0.x, a0.y), fmaxf(a0.z, a0.w)), fmaxf(fmaxf(a1.x, a1.y), fmaxf(a1.z, a1.w))));
      mx_hi = fmaxf(mx_hi, fmaxf(fmaxf(fmaxf(b0.x, b0.y), fmaxf(b0.z, b0.w)), fmaxf(fmaxf(b1.x, b1.y), fmaxf(b1.z, b1.w))));
    }
    {
      const float p0 = exp2f(s[0] - mx_lo), p1 = exp2f(s[1] - mx_lo);
      const float p2 = exp2f(s[2] - mx_hi), p3 = exp2f(s[3] - mx_hi);
      if constexpr (kReg) {
        // f16, each key at its place in the P . V k-step's key order: key
        // 8 w + 2 qd + e is position 8 (w & 1) + 4 (qd & 1) + 2 e + qd / 2 of
        // k-step w / 2 (the order of the value fragments below).
        __half* ph = reinterpret_cast<__half*>(p_smem);
        const int qd = lane & 3;
        const int col = (warp >> 1) * 16 + 8 * (warp & 1) + 4 * (qd & 1) + (qd >> 1);
        ph[r_lo * kPStride + col] = __float2half_rn(p0);
        ph[r_lo * kPStride + col + 2] = __float2half_rn(p1);
        ph[(r_lo + 8) * kPStride + col] = __float2half_rn(p2);
        ph[(r_lo + 8) * kPStride + col + 2] = __float2half_rn(p3);
      } else {
        *reinterpret_cast<uint32_t*>(p_smem + r_lo * kPStride + warp * 8 + c0) = pack_bf16x2(p0, p1);
        *reinterpret_cast<uint32_t*>(p_smem + (r_lo + 8) * kPStride + warp * 8 + c0) = pack_bf16x2(p2, p3);
      }
      float sum_lo = p0 + p1, sum_hi = p2 + p3;
      sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 1);
      sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 2);
      sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 1);
      sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 2);
      if ((lane & 3) == 0) {
        red_sum[r_lo * kWarps + warp] = sum_lo;
        red_sum[(r_lo + 8) * kWarps + warp] = sum_hi;
      }
    }
    __syncthreads();  // P, the sums and (FP8) every converted row are in shared memory
    float ds_mul = 1.0f;  // kReg && kDs: 2^-ds_exp, the factor of this tile's scales in P
    float o_corr = 1.0f;  // kReg && kDs: o's rescale when ds_exp grows
    if constexpr (kReg && kDs) {
      // The largest scale of this warp's latent tile (w / 2) over the tile's
      // 64 keys: P . V runs on P * scale / 2^ds_exp, in (0, 1) for every key
      // whatever the scales' magnitude (f16's range), o rescaled as ds_exp grows.
      const float* sc = reinterpret_cast<const float*>(raw_tile + kDsMlaScaleOffset) + (warp >> 1);
      float smax = fmaxf(sc[lane * (kRegRowBytes / 4)], sc[(lane + 32) * (kRegRowBytes / 4)]);
      smax = cuda_common::warp_max(smax);
      if (smax > 0.0f && isfinite(smax)) {
        int x;
        frexpf(smax, &x);  // smax < 2^x
        if (x > ds_exp) {
          o_corr = ldexpf(1.0f, ds_exp - x);
          ds_exp = x;
        }
      }
      ds_mul = ldexpf(1.0f, -ds_exp);
    }
    {
      const float l_corr_lo = exp2f(m_lo - mx_lo), l_corr_hi = exp2f(m_hi - mx_hi);
      const float corr_lo = l_corr_lo * o_corr, corr_hi = l_corr_hi * o_corr;
      m_lo = mx_lo;
      m_hi = mx_hi;
      const float4* a = reinterpret_cast<const float4*>(red_sum + r_lo * kWarps);
      const float4* b = reinterpret_cast<const float4*>(red_sum + (r_lo + 8) * kWarps);
      const float4 a0 = a[0], a1 = a[1], b0 = b[0], b1 = b[1];
      l_lo = l_lo * l_corr_lo + (((a0.x + a0.y) + (a0.z + a0.w)) + ((a1.x + a1.y) + (a1.z + a1.w)));
      l_hi = l_hi * l_corr_hi + (((b0.x + b0.y) + (b0.z + b0.w)) + ((b1.x + b1.y) + (b1.z + b1.w)));
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        o[n][0] *= corr_lo;
        o[n][1] *= corr_lo;
        o[n][2] *= corr_hi;
        o[n][3] *= corr_hi;
      }
    }
    // o[:, 64 w : +64] += P (16 x 64) . V (64 x 64).
#pragma unroll
    for (int kk = 0; kk < kWideKeys / 16; ++kk) {
      uint32_t a[4];
      ptx::ldmatrix_x4(ptx::smem_u32(p_smem + (lane & 15) * kPStride + kk * 16 + (lane >> 4) * 8), a[0], a[1], a[2],
                       a[3]);
      if constexpr (kReg) {
        // Value fragments from the e4m3 rows: k-step position 2 qd (+1, +8,
        // +9) is key qd (+4, +8, +12) of the 16 (consecutive rows across a
        // half warp: conflict-free), column g of n-tile j is dim
        // 64 w + 8 g + j. Bytes paired across two keys with byte permutes,
        // then converted: 4 loads, 8 permutes, 16 conversions for 8 MMAs.
        if constexpr (kDs) {
          // P times each key's scale of this warp's latent tile, over 2^ds_exp
          // (keys qd, qd + 4 in a[0], a[1]; qd + 8, qd + 12 in a[2], a[3]).
          const unsigned char* sk = raw_tile + (kk * 16 + (lane & 3)) * kRegRowBytes + kDsMlaScaleOffset + (warp >> 1) * 4;
          const float f0 = *reinterpret_cast<const float*>(sk) * ds_mul;
          const float f1 = *reinterpret_cast<const float*>(sk + 4 * kRegRowBytes) * ds_mul;
          const float f2 = *reinterpret_cast<const float*>(sk + 8 * kRegRowBytes) * ds_mul;
          const float f3 = *reinterpret_cast<const float*>(sk + 12 * kRegRowBytes) * ds_mul;
          const __half2 fa = __floats2half2_rn(f0, f1), fb = __floats2half2_rn(f2, f3);
          auto scale2 = [](uint32_t& r, __half2 f) {
            const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&r), f);
            r = *reinterpret_cast<const uint32_t*>(&v);
          };
          scale2(a[0], fa);
          scale2(a[1], fa);
          scale2(a[2], fb);
          scale2(a[3], fb);
        }
        const unsigned char* vb = raw_tile + (kk * 16 + (lane & 3)) * kRegRowBytes + warp * 64 + r_lo * 8;
        const uint2 r0 = *reinterpret_cast<const uint2*>(vb);
        const uint2 r1 = *reinterpret_cast<const uint2*>(vb + 4 * kRegRowBytes);
        const uint2 r2 = *reinterpret_cast<const uint2*>(vb + 8 * kRegRowBytes);
        const uint2 r3 = *reinterpret_cast<const uint2*>(vb + 12 * kRegRowBytes);
        const uint32_t x01[4] = {__byte_perm(r0.x, r1.x, 0x5140), __byte_perm(r0.x, r1.x, 0x7362),
                                 __byte_perm(r0.y, r1.y, 0x5140), __byte_perm(r0.y, r1.y, 0x7362)};
        const uint32_t x23[4] = {__byte_perm(r2.x, r3.x, 0x5140), __byte_perm(r2.x, r3.x, 0x7362),
                                 __byte_perm(r2.y, r3.y, 0x5140), __byte_perm(r2.y, r3.y, 0x7362)};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          ptx::mma_m16n8k16_f16_unordered(o[2 * m], a, e4m3x2_to_f16x2(x01[m]), e4m3x2_to_f16x2(x23[m]));
          ptx::mma_m16n8k16_f16_unordered(o[2 * m + 1], a, e4m3x2_to_f16x2(x01[m] >> 16),
                                          e4m3x2_to_f16x2(x23[m] >> 16));
        }
        continue;
      }
      const int key = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        const int col = warp * 64 + (2 * np + (lane >> 4)) * 8;
        uint32_t b0, b1, b2, b3;
        ptx::ldmatrix_x4_trans(ptx::smem_u32(kv + key * kRowElems + col), b0, b1, b2, b3);
        ptx::mma_m16n8k16_bf16_unordered(o[2 * np], a, b0, b1);
        ptx::mma_m16n8k16_bf16_unordered(o[2 * np + 1], a, b2, b3);
      }
    }
  }
  ptx::cp_async_wait<0>();

  // l_lo / l_hi are already the heads' full sums (the same in every lane of a head).
  if constexpr (kReg) {
    const float out_mul = kDs ? ldexpf(k_scale, ds_exp) : k_scale;  // fp8_ds_mla: o is in units of 2^ds_exp
    store_output16(p, o, i, split, h_lo, h_hi, warp * 64 + (lane & 3) * 16, out_mul / l_lo, out_mul / l_hi,
                   warp == 0 && (lane & 3) == 0, m_lo + log2f(l_lo), m_hi + log2f(l_hi));
    return;
  }
  store_output(p, o, i, split, h_lo, h_hi, warp * 64 + c0, k_scale / l_lo, k_scale / l_hi, warp == 0 && (lane & 3) == 0,
               m_lo + log2f(l_lo), m_hi + log2f(l_hi));
}

// o_lat[i, h, :] = sum_s w_s part_o[i, s, h, :], w = softmax over the row's splits of part_lse.
// Grid (num_heads, rows), 128 threads x 4 columns.
__global__ void __launch_bounds__(128) mla_decode_combine_kernel(const MlaDecodeAttnParams p) {
  __shared__ float w[kMlaDecodeMaxSplits];
  const int H = p.num_heads, h = blockIdx.x;
  const int64_t i = blockIdx.y;
  int seq;
  const int num_keys = row_keys(p.r, row_of(p.r, i), &seq);
  const int ns = mla_decode_detail::row_splits(num_keys, p.num_splits, p.min_split_keys, p.r.num_rows, p.key_tile);
  const int64_t base = i * p.num_splits * H + h;  // + s * H
  if (threadIdx.x < 32) mla_decode_detail::split_weights(p.part_lse + base, H, ns, w, threadIdx.x);
  __syncthreads();
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int c = threadIdx.x * 4;
  for (int s = 0; s < ns; ++s) {
    const float4 v =
        *reinterpret_cast<const float4*>(p.part_o + (base + static_cast<int64_t>(s) * H) * kMlaDecodeLora + c);
    const float ws = w[s];
    acc.x += ws * v.x;
    acc.y += ws * v.y;
    acc.z += ws * v.z;
    acc.w += ws * v.w;
  }
  uint2 out;
  out.x = pack_bf16x2(acc.x, acc.y);
  out.y = pack_bf16x2(acc.z, acc.w);
  *reinterpret_cast<uint2*>(p.o_lat + (i * H + h) * kMlaDecodeLora + c) = out;
}

// One block per row: 16-byte copies of q_nope (16 chunks/head) and q_pe (8 chunks/head).
__global__ void mla_decode_gather_q_kernel(const MlaDecodeRows r, const __nv_bfloat16* __restrict__ q,
                                           int64_t q_stride, int num_heads, __nv_bfloat16* __restrict__ q_nope_c,
                                           __nv_bfloat16* __restrict__ q_full) {
  const int64_t i = blockIdx.x, row = row_of(r, i);
  constexpr int kPerHead = (kMlaDecodeNope + kMlaDecodeRope) / 8;  // 24
  for (int c = threadIdx.x; c < num_heads * kPerHead; c += blockDim.x) {
    const int h = c / kPerHead, k = c - h * kPerHead;
    const uint4 v = *reinterpret_cast<const uint4*>(q + row * q_stride + h * (kMlaDecodeNope + kMlaDecodeRope) + k * 8);
    if (k < kMlaDecodeNope / 8)
      *reinterpret_cast<uint4*>(q_nope_c + (i * num_heads + h) * kMlaDecodeNope + k * 8) = v;
    else
      *reinterpret_cast<uint4*>(q_full + (i * num_heads + h) * kMlaDecodeLatent + kMlaDecodeLora +
                                (k - kMlaDecodeNope / 8) * 8) = v;
  }
}

__global__ void mla_decode_scatter_kernel(const MlaDecodeRows r, const __nv_bfloat16* __restrict__ src,
                                          int64_t width, __nv_bfloat16* __restrict__ out, int64_t out_stride) {
  const int64_t i = blockIdx.x, row = row_of(r, i);
  for (int64_t c = threadIdx.x; c < width / 8; c += blockDim.x)
    *reinterpret_cast<uint4*>(out + row * out_stride + c * 8) = *reinterpret_cast<const uint4*>(src + i * width + c * 8);
}

__global__ void mla_decode_dequant_kernel(const WeightView w, __nv_bfloat16* __restrict__ out) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= w.n * w.k) return;
  out[idx] = __float2bfloat16(w.at(idx / w.k, idx % w.k));
}

// Launches an attention kernel (heads_per_group heads a CTA) over the call's
// rows in grid-z slices of at most 65535: launch_slice(q, grid) for each
// slice's params q, then the combine kernel when the call is split and
// combines.
template <class LaunchSlice>
cudaError_t launch_split_grid(int heads_per_group, const MlaDecodeAttnParams& p, cudaStream_t stream,
                              LaunchSlice&& launch_slice) {
  const int groups = (p.num_heads + heads_per_group - 1) / heads_per_group;
  constexpr int64_t kMaxGridZ = 65535;
  for (int64_t r0 = 0; r0 < p.r.num_rows; r0 += kMaxGridZ) {
    const int64_t n = std::min(kMaxGridZ, p.r.num_rows - r0);
    MlaDecodeAttnParams q = p;
    q.r.rows = p.r.rows ? p.r.rows + r0 : nullptr;
    q.r.row_offset = p.r.row_offset + r0;
    q.r.num_rows = n;
    q.q_full = p.q_full + r0 * p.num_heads * kMlaDecodeLatent;
    q.o_lat = p.o_lat + r0 * p.num_heads * kMlaDecodeLora;
    if (p.num_splits > 1) {
      q.part_o = p.part_o + r0 * p.num_splits * p.num_heads * kMlaDecodeLora;
      q.part_lse = p.part_lse + r0 * p.num_splits * p.num_heads;
    }
    const cudaError_t e = launch_slice(q, dim3(groups, p.num_splits, static_cast<unsigned>(n)));
    if (e != cudaSuccess) return e;
    if (p.num_splits > 1 && p.combine)
      mla_decode_combine_kernel<<<dim3(p.num_heads, static_cast<unsigned>(n)), 128, 0, stream>>>(q);
  }
  return cudaGetLastError();
}

// launch_split_grid for attention kernel kKernel with smem bytes of shared
// memory. (A template on the kernel, so that each kernel sets its
// shared-memory limit once.)
template <auto kKernel>
cudaError_t launch_attention_grid(size_t smem, int heads_per_group, const MlaDecodeAttnParams& p,
                                  cudaStream_t stream) {
  const cudaError_t attr = cuda_common::once_per_device([smem] {
    return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  });
  if (attr != cudaSuccess) return attr;
  return launch_split_grid(heads_per_group, p, stream, [&](const MlaDecodeAttnParams& q, dim3 grid) {
    return pdl::launch(kKernel, grid, kThreads, smem, p.pdl, stream, q);
  });
}

template <int M, bool kFp8, bool kDs = false, int kPerSm = 1>
cudaError_t launch_attention_m(const MlaDecodeAttnParams& p, cudaStream_t stream) {
  return launch_attention_grid<mla_decode_attention_kernel<M, kFp8, kDs, kPerSm>>(
      attention_smem_bytes<M, kFp8, kDs, kPerSm>(), 16 * M, p, stream);
}

template <bool kFp8, bool kDs>
cudaError_t launch_attention64(const MlaDecodeAttnParams& p, cudaStream_t stream) {
  if constexpr (kFp8) {
    if (p.fp8_register_convert) {
      constexpr size_t smem = wide_smem_bytes<true, kDs, true>();
      if (p.bulk_loads)
        return launch_attention_grid<mla_decode_attention64_kernel<true, kDs, true, true>>(smem, 16, p, stream);
      return launch_attention_grid<mla_decode_attention64_kernel<true, kDs, false, true>>(smem, 16, p, stream);
    }
  }
  if (p.bulk_loads)
    return launch_attention_grid<mla_decode_attention64_kernel<kFp8, kDs, true>>(wide_smem_bytes<kFp8, kDs>(), 16, p,
                                                                                 stream);
  return launch_attention_grid<mla_decode_attention64_kernel<kFp8, kDs, false>>(wide_smem_bytes<kFp8, kDs>(), 16, p,
                                                                                stream);
}

}  // namespace

int mla_decode_heads_per_cta(int num_heads) { return num_heads <= 16 ? 16 : 32; }

int mla_decode_num_splits(int64_t num_rows, int num_heads, int heads_per_cta, int num_sms) {
  const int64_t groups = (num_heads + heads_per_cta - 1) / heads_per_cta;
  const int64_t base = num_rows * groups;  // CTAs per split
  if (base >= num_sms || num_sms <= 0) return 1;
  // Among split counts up to two waves, the best fill of the waves it uses
  // (a larger count only when it fills noticeably better). The 64-head
  // wgmma kernel (one CTA a multiprocessor) stays within one wave: a second,
  // partly filled wave of its CTAs costs a whole split's time (4 rows x 4096
  // keys x 128 heads: 22 splits in two waves 58.7 us, 16 in one 47.4 us;
  // docs/perf.md "MLA decode on wgmma").
  const int64_t max_s = heads_per_cta == kMlaDecodeWgmmaHeads
                            ? std::max<int64_t>(1, std::min<int64_t>(kMlaDecodeMaxSplits, num_sms / base))
                            : std::min<int64_t>(kMlaDecodeMaxSplits, (2 * num_sms + base - 1) / base);
  int best = 1;
  double best_fill = static_cast<double>(base) / num_sms;
  for (int64_t s = 2; s <= max_s; ++s) {
    const int64_t ctas = base * s, waves = (ctas + num_sms - 1) / num_sms;
    const double fill = static_cast<double>(ctas) / static_cast<double>(waves * num_sms);
    if (fill > best_fill + 0.02) {
      best_fill = fill;
      best = static_cast<int>(s);
    }
  }
  return best;
}

cudaError_t launch_mla_decode_gather_q(const MlaDecodeRows& r, const __nv_bfloat16* q, int64_t q_stride,
                                       int num_heads, __nv_bfloat16* q_nope_c, __nv_bfloat16* q_full,
                                       cudaStream_t stream) {
  if (r.num_rows == 0) return cudaSuccess;
  mla_decode_gather_q_kernel<<<static_cast<unsigned>(r.num_rows), 256, 0, stream>>>(r, q, q_stride, num_heads,
                                                                                    q_nope_c, q_full);
  return cudaGetLastError();
}

cudaError_t launch_mla_decode_attention(const MlaDecodeAttnParams& p, cudaStream_t stream) {
  if (p.r.num_rows == 0) return cudaSuccess;
  if (p.num_splits < 1 || p.num_splits > kMlaDecodeMaxSplits || p.r.block_size < 1) return cudaErrorInvalidValue;
  if (p.min_split_keys < 0 || p.min_split_keys % kTileKeys != 0) return cudaErrorInvalidValue;
  if (p.num_splits > 1 && (p.part_o == nullptr || p.part_lse == nullptr)) return cudaErrorInvalidValue;
  if (p.cache_fp8 && !(p.k_scale > 0.0f)) return cudaErrorInvalidValue;
  if (p.ctas_per_sm != 1 && !(p.ctas_per_sm == 2 && p.heads_per_cta == 16)) return cudaErrorInvalidValue;
  if (p.heads_per_cta == kMlaDecodeWgmmaHeads) {
    if (p.key_tile != kMlaDecodeWideTileKeys || p.ctas_per_sm != 1 || (p.cache_fp8 && p.cache_ds_mla) ||
        p.num_heads % kMlaDecodeWgmmaHeads != 0)
      return cudaErrorInvalidValue;
    return launch_split_grid(kMlaDecodeWgmmaHeads, p, stream, [&](const MlaDecodeAttnParams& q, dim3 grid) {
      return mla_decode_detail::launch_attention_wgmma_slice(q, grid, stream);
    });
  }
  if (p.key_tile == kMlaDecodeWideTileKeys) {
    if (p.heads_per_cta != 16 || p.ctas_per_sm != 1 || (p.cache_fp8 && p.cache_ds_mla)) return cudaErrorInvalidValue;
    if (p.cache_ds_mla) return launch_attention64<true, true>(p, stream);
    return p.cache_fp8 ? launch_attention64<true, false>(p, stream) : launch_attention64<false, false>(p, stream);
  }
  if (p.key_tile != kMlaDecodeTileKeys) return cudaErrorInvalidValue;
  if (p.ctas_per_sm == 2) {
    if (p.cache_ds_mla) return p.cache_fp8 ? cudaErrorInvalidValue : launch_attention_m<1, true, true, 2>(p, stream);
    return p.cache_fp8 ? launch_attention_m<1, true, false, 2>(p, stream) : launch_attention_m<1, false, false, 2>(p, stream);
  }
  if (p.cache_ds_mla) {
    if (p.cache_fp8) return cudaErrorInvalidValue;
    if (p.heads_per_cta == 16) return launch_attention_m<1, true, true>(p, stream);
    if (p.heads_per_cta == 32) return launch_attention_m<2, true, true>(p, stream);
    return cudaErrorInvalidValue;
  }
  switch (p.heads_per_cta * 2 + (p.cache_fp8 ? 1 : 0)) {
    case 32: return launch_attention_m<1, false>(p, stream);
    case 33: return launch_attention_m<1, true>(p, stream);
    case 64: return launch_attention_m<2, false>(p, stream);
    case 65: return launch_attention_m<2, true>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_mla_decode_scatter_out(const MlaDecodeRows& r, const __nv_bfloat16* out_c, int64_t width,
                                          __nv_bfloat16* out, int64_t out_stride, cudaStream_t stream) {
  if (r.num_rows == 0) return cudaSuccess;
  if (width % 8 != 0 || out_stride % 8 != 0) return cudaErrorInvalidValue;
  mla_decode_scatter_kernel<<<static_cast<unsigned>(r.num_rows), 128, 0, stream>>>(r, out_c, width, out, out_stride);
  return cudaGetLastError();
}

cudaError_t launch_mla_decode_dequant_weight(const WeightView& w, __nv_bfloat16* w_bf16, cudaStream_t stream) {
  const int64_t total = w.n * w.k;
  if (total == 0) return cudaSuccess;
  mla_decode_dequant_kernel<<<cuda_common::ceil_div(total, 256), 256, 0, stream>>>(w, w_bf16);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
