// Absorbed-form MLA decode attention for 64 heads a CTA on Hopper wgmma
// (MlaDecodeAttnParams::heads_per_cta == 64; semantics: mla_decode.cuh).
//
// CTA: one query row x one KV split x 64 heads (the wgmma M), two warpgroups.
// Shared memory (1024-byte aligned, every tile stored as 64-dim column blocks
// of 128-byte rows with the tensor cores' 128-byte swizzle):
//   Q      [64 heads x 576]      loaded once
//   K/V[2] [64 keys x 576]       the key tile t in buffer t & 1; its first
//                                512 dims are also the value rows
//   P      [64 heads x 64 keys]  bf16 softmax weights of the tile
// Per 64-key tile:
//   1. warpgroup 0 scores the tile: S = Q K^T, 36 wgmma m64n64k16 (both
//      operands from shared memory; one warpgroup keeps the tensor cores
//      busy, and m64n64 reads as many shared-memory bytes as it multiplies);
//   2. warpgroup 0 runs the online softmax (log2 units, keys past the split
//      masked) and hands P (bf16) and each head's rescaling factor to
//      warpgroup 1 through shared memory;
//   3. each warpgroup w accumulates o_lat columns [256 w, +256):
//      O_w = O_w corr + P V[:, 256 w : +256], 4 wgmma m64n256k16 with V
//      MN-major (the key tile read transposed); warpgroup 0 takes P from its
//      registers (the score accumulators are the A fragments), warpgroup 1
//      from shared memory.
// Tile t + 1 streams in while tile t is computed: warpgroup 1 issues its
// 16-byte cp.async pieces into the swizzled layout (zero-filled past the
// split's end) while warpgroup 0 scores, so the block-table lookups never
// delay the score products. Split partials
// and log-sum-exps are stored exactly as the mma.sync kernels store them
// (store_output), so the combine and output kernels are shared.
// FP8 rows (RowFormat below) reach the same bf16 key tiles through
// warpgroup 1's registers, never through a raw tile in shared memory: it
// loads tile t + 2's rows from global memory into registers while tile t is
// computed, and at the start of tile t + 1 converts them and stores the bf16
// values into the swizzled layout, so the loads have a whole tile to land.
//  - e4m3 rows (cache_fp8): converted exactly; the layer's k_scale is
//    factored out (scores p.scale * k_scale * q . stored, o_lat = k_scale *
//    sum_j p_j stored_j), as in the mma.sync kernels;
//  - fp8_ds_mla rows (cache_ds_mla, kernels/mla/ds_mla_row.h): each latent
//    value read as bf16(f32(stored) * its tile's scale), one rounding, as in
//    the mma.sync kernels' conversion tile; the rope part (bf16 already)
//    copied by cp.async.
// Shared memory: 3 x 72 KB + 8 KB + 0.75 KB: one CTA a multiprocessor.
#include "kernels/common/cuda_common.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wgmma.cuh"
#include "kernels/mla/ds_mla_row.h"
#include "kernels/mla/mla_decode.cuh"
#include "kernels/mla/mla_decode_rows.cuh"

namespace nucleus::kernels::mla_decode_detail {

namespace {

constexpr int kHeads = kMlaDecodeWgmmaHeads;  // 64: the wgmma M
constexpr int kKeys = kMlaDecodeWideTileKeys;  // 64 keys a tile
constexpr int kThreads = 256;                  // two warpgroups
constexpr int kBlocks = kMlaDecodeLatent / 64;  // 9 column blocks of 64 dims
constexpr uint32_t kBlockBytes = 64 * 128;      // a column block of a 64-row tile
constexpr uint32_t kTileBytes = kBlocks * kBlockBytes;  // 73,728: Q or one key tile
constexpr int kRowBytes = kMlaDecodeLatent * 2;          // a bf16 cache row
constexpr size_t kSmemBytes = 1024 /* alignment */ + 3 * kTileBytes + kBlockBytes /* P */ +
                              3 * kHeads * sizeof(float) /* rescaling factors, row sums, maxima */;
static_assert(kSmemBytes <= 227 * 1024, "one CTA a multiprocessor");
constexpr float kLog2e = 1.4426950408889634f;

// Copies rows r + (64 / kRows) h (h < kRows) of a 64-row tile into the
// swizzled tile at s_tile, r = tid / 8 for the calling thread's index tid
// (< 8 * 64 / kRows): chunk tid % 8 of each of the 9 column blocks. src[h]: row h's
// first byte plus this thread's chunk, or null (zero-filled; the copy then
// reads nothing from `dummy`).
template <int kRows>
__device__ __forceinline__ void load_rows(uint32_t s_tile, int tid, const unsigned char* const (&src)[kRows],
                                          const void* dummy) {
  constexpr int kStep = 64 / kRows;  // rows between a thread's rows: a multiple of 8, so they share the swizzle
  static_assert(kStep % 8 == 0, "a thread's rows share their swizzle");
  const int c = tid & 7, r = tid >> 3;
  const uint32_t dst = s_tile + r * 128 + ((c ^ (r & 7)) << 4);
#pragma unroll
  for (int h = 0; h < kRows; ++h) {
    const bool ok = src[h] != nullptr;
#pragma unroll
    for (int b = 0; b < kBlocks; ++b)
      ptx::cp_async_16(dst + h * kStep * 128 + b * kBlockBytes, ok ? src[h] + b * 128 : dummy, ok ? 16 : 0);
  }
}

// o *= corr per accumulator row (rows g and g + 8 of the warp): skipped by a
// warp whose factors are all 1 (its rows' maxima did not grow), which is
// exact and, past the first tiles of a split, the common case.
__device__ __forceinline__ void rescale(float (&o)[32][4], const float (&corr)[2]) {
  if (!__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) return;
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    o[n][0] *= corr[0];
    o[n][1] *= corr[0];
    o[n][2] *= corr[1];
    o[n][3] *= corr[1];
  }
}

// How the cache stores a row: bf16 (576 values), e4m3 (576 bytes, cache_fp8)
// or fp8_ds_mla (656 bytes, cache_ds_mla).
enum class RowFormat { kBf16, kFp8, kDsMla };

template <RowFormat kFmt>
constexpr int row_bytes() {
  return kFmt == RowFormat::kBf16 ? kRowBytes : kFmt == RowFormat::kFp8 ? kMlaDecodeLatent : kDsMlaRowBytes;
}

// One FP8 tile's share of a warpgroup-1 thread (ltid < 128): row ltid / 2 of
// the tile, its 16-byte chunks c = 2 j + (ltid & 1) of the converted part
// (e4m3 rows: all 36 chunks of 576 values; fp8_ds_mla: the 32 latent chunks,
// the rope part copied separately), held in registers from the load to the
// conversion. Rows past the split's end hold zeros.
template <RowFormat kFmt>
struct RowFetch {
  static constexpr int kChunks = (kFmt == RowFormat::kFp8 ? kMlaDecodeLatent : kDsMlaLatent) / 32;  // 18 or 16
  uint4 v[kChunks];
  float sc[4];                          // fp8_ds_mla: the row's tile scales
  const unsigned char* row = nullptr;  // fp8_ds_mla: the row (null past the split's end)
};

// The cache row of thread ltid's share of key tile t, or null past the
// split's end (its block-table lookup, issued ahead of fetch_rows).
template <RowFormat kFmt>
__device__ __forceinline__ const unsigned char* fetch_row(const MlaDecodeAttnParams& p, const SplitKeys& sk, int t,
                                                          int ltid) {
  const int key = sk.k_begin + t * kKeys + (ltid >> 1);
  return key < sk.k_end ? cache_row(p, sk.table, key, row_bytes<kFmt>()) : nullptr;
}

// Loads thread ltid's share of a key tile from its row (fetch_row), zeros for null.
template <RowFormat kFmt>
__device__ __forceinline__ void fetch_rows(const unsigned char* row, int ltid, RowFetch<kFmt>& f) {
  const int half = ltid & 1;
  if (row != nullptr) {
#pragma unroll
    for (int j = 0; j < RowFetch<kFmt>::kChunks; ++j) f.v[j] = __ldg(reinterpret_cast<const uint4*>(row) + 2 * j + half);
    if constexpr (kFmt == RowFormat::kDsMla) {
      const float4 s4 = __ldg(reinterpret_cast<const float4*>(row + kDsMlaScaleOffset));
      f.sc[0] = s4.x;
      f.sc[1] = s4.y;
      f.sc[2] = s4.z;
      f.sc[3] = s4.w;
      f.row = row;
    }
  } else {
#pragma unroll
    for (int j = 0; j < RowFetch<kFmt>::kChunks; ++j) f.v[j] = make_uint4(0, 0, 0, 0);
    f.sc[0] = f.sc[1] = f.sc[2] = f.sc[3] = 0.0f;
    f.row = nullptr;
  }
}

// Converts thread ltid's share fetched by fetch_rows into the swizzled bf16
// key tile at s_tile (chunk c = 16 values -> bf16 bytes [32 c, +32) of the
// row: column block c / 4, 16-byte chunks 2 (c % 4) and + 1); fp8_ds_mla
// rows also get their rope part (bf16, 8 chunks: 4 a thread) by cp.async,
// zero-filled past the split's end (the copy then reads nothing from `dummy`).
template <RowFormat kFmt>
__device__ __forceinline__ void store_rows(uint32_t s_tile, int ltid, const RowFetch<kFmt>& f, const void* dummy) {
  const int r = ltid >> 1, half = ltid & 1;
  const uint32_t row_base = s_tile + r * 128;
#pragma unroll
  for (int j = 0; j < RowFetch<kFmt>::kChunks; ++j) {
    const int c = 2 * j + half;
    const uint32_t w[4] = {f.v[j].x, f.v[j].y, f.v[j].z, f.v[j].w};
    uint32_t out[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) e4m3x4_to_bf16x4_nan_kept(w[e], out[2 * e], out[2 * e + 1]);
    if constexpr (kFmt == RowFormat::kDsMla) {
      const float sc = f.sc[j >> 2];  // chunks 8 k .. 8 k + 7 are tile k (128 values)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        out[e] = pack_bf16x2(__uint_as_float(out[e] << 16) * sc, __uint_as_float(out[e] & 0xffff0000u) * sc);
    }
    const uint32_t dst = row_base + (c >> 2) * kBlockBytes, k0 = 2 * (c & 3);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + ((k0 ^ (r & 7)) << 4)), "r"(out[0]),
                 "r"(out[1]), "r"(out[2]), "r"(out[3])
                 : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + (((k0 + 1) ^ (r & 7)) << 4)), "r"(out[4]),
                 "r"(out[5]), "r"(out[6]), "r"(out[7])
                 : "memory");
  }
  if constexpr (kFmt == RowFormat::kDsMla) {
    const uint32_t dst = row_base + (kMlaDecodeLora / 64) * kBlockBytes;
#pragma unroll
    for (int q = 4 * half; q < 4 * half + 4; ++q)
      ptx::cp_async_16(dst + ((q ^ (r & 7)) << 4), f.row ? f.row + kDsMlaRopeOffset + 16 * q : dummy,
                       f.row ? 16 : 0);
  }
}

template <RowFormat kFmt>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_attention_wgmma_kernel(const MlaDecodeAttnParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t s_raw = ptx::smem_u32(smem);
  const uint32_t s_q = (s_raw + 1023u) & ~1023u;
  const uint32_t s_k = s_q + kTileBytes;        // two key tiles
  const uint32_t s_p = s_k + 2 * kTileBytes;    // P
  float* s_corr = reinterpret_cast<float*>(smem + (s_p + kBlockBytes - s_raw));  // [64 heads]
  float* s_sum = s_corr + kHeads;                                                 // [64 heads]
  float* s_max = s_sum + kHeads;                                                  // [64 heads]

  const int H = p.num_heads, group = blockIdx.x, split = blockIdx.y;
  const int64_t i = blockIdx.z;
  const SplitKeys sk = split_keys<kKeys>(p, i, split);
  if (sk.num_tiles == 0) return;  // this row needs fewer splits

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // the warpgroup, provably uniform across the warp
  constexpr bool kBf16 = kFmt == RowFormat::kBf16;
  const auto* cache = static_cast<const unsigned char*>(p.cache);
  // Key tile t into buffer t & 1, by warpgroup 1 (ltid = its thread index):
  // rows ltid / 8 + 16 h, h < 4 (warpgroup 0 is scoring meanwhile). FP8:
  // tile t + 2's rows held in `fetch` (warpgroup 1) from tile t to t + 1.
  auto load_k = [&](int t, int ltid) {
    const int key = sk.k_begin + t * kKeys + (ltid >> 3), c = (ltid & 7) * 16;
    const unsigned char* src[4];
#pragma unroll
    for (int h = 0; h < 4; ++h)
      src[h] = key + 16 * h < sk.k_end ? cache_row(p, sk.table, key + 16 * h, kRowBytes) + c : nullptr;
    load_rows<4>(s_k + (t & 1) * kTileBytes, ltid, src, cache);
  };
  [[maybe_unused]] RowFetch<kFmt> fetch;
  if (wg == 1) {
    if constexpr (kBf16) {
      load_k(0, tid - 128);
    } else {
      fetch_rows(fetch_row<kFmt>(p, sk, 0, tid - 128), tid - 128, fetch);
      store_rows(s_k, tid - 128, fetch, cache);
      if (sk.num_tiles > 1) fetch_rows(fetch_row<kFmt>(p, sk, 1, tid - 128), tid - 128, fetch);
    }
  }
  ptx::cp_async_commit();
  // As a programmatic dependent (PDL) of the q absorption: the first cache
  // rows (written before it) are on their way; q_full is read only after it
  // has finished.
  pdl::wait_for_inputs();
  pdl::launch_dependents();
  {
    const auto* q = reinterpret_cast<const unsigned char*>(p.q_full + (i * H + group * kHeads) * kMlaDecodeLatent);
    const int r = tid >> 3, c = (tid & 7) * 16;
    const unsigned char* const src[2] = {q + r * kRowBytes + c, q + (r + 32) * kRowBytes + c};
    load_rows<2>(s_q, tid, src, q);
  }
  ptx::cp_async_commit();

  // This thread's accumulator rows: heads row_lo and row_lo + 8 of the group
  // (lane / 4 = g), columns 8 j + 2 q4 (+1) of each 8-column block.
  const int q4 = lane & 3, row_lo = warp * 16 + (lane >> 2);
  float o[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  // Warpgroup 0: running max (log2 units) and this thread's part of the row sums.
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  // e4m3 rows: the layer's k_scale factored out of the scores here and of o_lat at the end.
  const float k_scale = kFmt == RowFormat::kFp8 ? p.k_scale : 1.0f;
  const float scale_log2 = p.scale * k_scale * kLog2e;

  for (int t = 0; t < sk.num_tiles; ++t) {
    ptx::cp_async_wait<0>();
    wgmma::fence_proxy_async();
    __syncthreads();  // K(t) (and Q) visible to all; both warpgroups are done with tile t - 1
    if (wg == 1) {
      if constexpr (kBf16) {
        if (t + 1 < sk.num_tiles) load_k(t + 1, tid - 128);  // into tile t - 1's buffer
      } else {
        // Tile t + 2's block-table lookup first: its latency passes during the conversion.
        const unsigned char* row = t + 2 < sk.num_tiles ? fetch_row<kFmt>(p, sk, t + 2, tid - 128) : nullptr;
        if (t + 1 < sk.num_tiles) store_rows(s_k + ((t + 1) & 1) * kTileBytes, tid - 128, fetch, cache);
        if (t + 2 < sk.num_tiles) fetch_rows(row, tid - 128, fetch);
      }
      ptx::cp_async_commit();
    }
    const uint32_t s_kt = s_k + (t & 1) * kTileBytes;
    const uint64_t dv = wgmma::smem_desc(s_kt + wg * 4 * kBlockBytes, kBlockBytes, 1024);  // V[:, 256 wg : +256]
    float corr[2];
    uint32_t pa[4][4];  // warpgroup 0: P as the A fragments of its P V (k-step kk = keys [16 kk, +16))
    if (wg == 0) {
      // 1. S = Q K^T (k-step kk: column block kk / 4, 32 bytes a step inside its 128-byte rows).
      float s[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
      {
        const uint64_t dq = wgmma::smem_desc(s_q, 16, 1024), dk = wgmma::smem_desc(s_kt, 16, 1024);
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < kMlaDecodeLatent / 16; ++kk) {
          const uint32_t step = (kk >> 2) * kBlockBytes + (kk & 3) * 32;
          wgmma::m64n64k16_ss(s, wgmma::desc_advance(dq, step), wgmma::desc_advance(dk, step));
        }
      }
      wgmma::commit();
      wgmma::wait<0>();

      // 2. Online softmax in log2 units, keys past the split masked (every tile holds a
      //    visible key, so the maxima are finite).
      const int key0 = sk.k_begin + t * kKeys + 2 * q4;
      float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = key0 + 8 * j + (e & 1) < sk.k_end ? s[j][e] * scale_log2 : -INFINITY;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        corr[r] = exp2f(m_run[r] - mx[r]);  // 0 on the first tile
        m_run[r] = mx[r];
        l_run[r] *= corr[r];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = exp2f(s[j][e] - m_run[e >> 1]);
          l_run[e >> 1] += s[j][e];
        }
      // P as bf16: warpgroup 0's A fragments, and the shared P tile for warpgroup 1 (row r,
      // keys 8 j + 2 q4 (+1): 16-byte chunk j of the 128-byte row).
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        pa[kk][0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t lo = s_p + row_lo * 128 + ((j ^ (row_lo & 7)) << 4) + q4 * 4;
        const uint32_t hi = s_p + (row_lo + 8) * 128 + ((j ^ ((row_lo + 8) & 7)) << 4) + q4 * 4;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(lo), "r"(pa[j >> 1][(j & 1) * 2]) : "memory");
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(hi), "r"(pa[j >> 1][(j & 1) * 2 + 1]) : "memory");
      }
      if (q4 == 0) {
        s_corr[row_lo] = corr[0];
        s_corr[row_lo + 8] = corr[1];
      }
      wgmma::fence_proxy_async();  // P's generic-proxy stores before the tensor cores read it
    }
    __syncthreads();  // P and the factors of tile t ready for warpgroup 1
    if (wg == 1) {
      corr[0] = s_corr[row_lo];
      corr[1] = s_corr[row_lo + 8];
    }
    // 3. O_w = O_w corr + P V[:, 256 w : +256]: warpgroup 0 with P from registers, 1 from shared memory.
    rescale(o, corr);
    if (wg == 0) {
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma::m64n256k16_rs_tb(o, pa[kk], wgmma::desc_advance(dv, kk * 16 * 128));
      wgmma::commit();
      wgmma::wait<0>();
    } else {
      const uint64_t dp = wgmma::smem_desc(s_p, 16, 1024);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma::m64n256k16_ss_tb(o, wgmma::desc_advance(dp, kk * 32), wgmma::desc_advance(dv, kk * 16 * 128));
      wgmma::commit();
      wgmma::wait<0>();
    }
  }
  ptx::cp_async_wait<0>();  // nothing in flight at exit

  // Row sums (warpgroup 0 summed its quads' parts) and maxima to warpgroup 1.
  if (wg == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
    if (q4 == 0) {
      s_sum[row_lo] = l_run[0];
      s_sum[row_lo + 8] = l_run[1];
      s_max[row_lo] = m_run[0];
      s_max[row_lo + 8] = m_run[1];
    }
  }
  __syncthreads();
  const float l_lo = s_sum[row_lo], l_hi = s_sum[row_lo + 8];
  const float lse_lo = s_max[row_lo] + log2f(l_lo), lse_hi = s_max[row_lo + 8] + log2f(l_hi);
  const int h_lo = group * kHeads + row_lo;
  store_output(p, o, i, split, h_lo, h_lo + 8, wg * 256 + 2 * q4, k_scale / l_lo, k_scale / l_hi,
               wg == 0 && q4 == 0, lse_lo, lse_hi);
}

}  // namespace

template <RowFormat kFmt>
cudaError_t launch_format(const MlaDecodeAttnParams& p, dim3 grid, cudaStream_t stream) {
  const cudaError_t attr = cuda_common::once_per_device([] {
    return cudaFuncSetAttribute(mla_decode_attention_wgmma_kernel<kFmt>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kSmemBytes));
  });
  if (attr != cudaSuccess) return attr;
  return pdl::launch(mla_decode_attention_wgmma_kernel<kFmt>, grid, kThreads, kSmemBytes, p.pdl, stream, p);
}

cudaError_t launch_attention_wgmma_slice(const MlaDecodeAttnParams& p, dim3 grid, cudaStream_t stream) {
  if (p.cache_fp8 && p.cache_ds_mla) return cudaErrorInvalidValue;
  if (p.cache_ds_mla) return launch_format<RowFormat::kDsMla>(p, grid, stream);
  return p.cache_fp8 ? launch_format<RowFormat::kFp8>(p, grid, stream) : launch_format<RowFormat::kBf16>(p, grid, stream);
}

}  // namespace nucleus::kernels::mla_decode_detail
