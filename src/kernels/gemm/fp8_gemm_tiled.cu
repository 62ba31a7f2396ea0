// FP8 block-scaled GEMM for any shape: CTA tile 128 tokens x 128 weight rows,
// k steps of 32 through a 4-stage cp.async pipeline (element copies with
// bounds checks when rows are not 16-byte aligned). The e4m3 weights stay
// bytes in shared memory and become bf16 when their MMA fragment is loaded
// (4 bytes per lane per k16, integer conversion), so each weight byte is
// converted once per warp that reads it and shared memory holds half as much.
//
// MMA roles: A = x (16 tokens x 16 k), B = weights (16 k x 8 rows). As in the
// decode kernel the k slots are permuted so that a lane's fragment comes from
// 4 consecutive k: slots {2q, 2q+1} <-> k = 4q + {0, 1}, {2q+8, 2q+9} <-> 4q +
// {2, 3} (q = lane % 4) — one 8-byte load per x row, one 4-byte load of
// weights. Partial sums of a 128-wide k block are scaled by scale_inv once.
#include "kernels/common/cuda_common.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/gemm/fp8_gemm.cuh"

namespace nucleus::kernels {

namespace {

constexpr int kBm = 128;  // tokens per CTA
constexpr int kBn = 128;  // weight rows per CTA (one scale row)
constexpr int kBk = 32;   // k per stage
constexpr int kStages = 4;
constexpr int kThreads = 256;
// Padded shared-memory rows: a warp's 8-byte x loads (4 rows x 32 bytes per
// half-warp) and 4-byte weight loads (8 rows x 16 bytes) hit distinct banks.
constexpr int kXRow = kBk + 16;  // bf16 elements (96 bytes)
constexpr int kWRow = kBk + 16;  // bytes
constexpr int kXStageBytes = kBm * kXRow * 2;
constexpr int kWStageBytes = kBn * kWRow;
constexpr int kStageBytes = kXStageBytes + kWStageBytes;
constexpr int kSmemBytes = kStages * kStageBytes;
static_assert(kFp8Block % kBk == 0 && kBn == kFp8Block, "tile must nest in scale blocks");

struct TiledParams {
  const __nv_bfloat16* x;
  int64_t x_stride;
  int64_t m;
  const uint8_t* w;
  const float* scale_inv;
  int64_t n, k;
  int64_t kb_count;
  void* out;
  int64_t out_stride;
  bool accumulate;
};

// kVec: k % 16 == 0, x_stride % 8 == 0, x and w 16-byte aligned.
template <bool kVec>
__device__ __forceinline__ void load_stage(const TiledParams& p, uint8_t* stage, int64_t tok0, int64_t row0,
                                           int64_t k0) {
  const int tid = threadIdx.x;
  {  // weights: 128 rows x 32 bytes, 16 bytes per thread
    const int r = tid >> 1, c = (tid & 1) * 16;
    const int64_t gr = row0 + r, gk = k0 + c;
    uint8_t* dst = stage + kXStageBytes + r * kWRow + c;
    if (kVec) {
      const bool ok = gr < p.n && gk < p.k;
      ptx::cp_async_16(dst, ok ? p.w + gr * p.k + gk : p.w, ok ? 16 : 0);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) dst[i] = gr < p.n && gk + i < p.k ? p.w[gr * p.k + gk + i] : 0;
    }
  }
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(stage);
#pragma unroll
  for (int it = 0; it < 2; ++it) {  // x: 128 rows x 32 bf16, 2 x 8 elements per thread
    const int ci = tid + it * kThreads;
    const int r = ci >> 2, c = (ci & 3) * 8;
    const int64_t gt = tok0 + r, gk = k0 + c;
    __nv_bfloat16* dst = xs + r * kXRow + c;
    if (kVec) {
      const bool ok = gt < p.m && gk < p.k;
      ptx::cp_async_16(dst, ok ? p.x + gt * p.x_stride + gk : p.x, ok ? 16 : 0);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        dst[i] = gt < p.m && gk + i < p.k ? p.x[gt * p.x_stride + gk + i] : __float2bfloat16_rn(0.0f);
    }
  }
}

template <bool kVec, typename Out>
__global__ void __launch_bounds__(kThreads, 1) fp8_tiled_kernel(const TiledParams p) {
  using namespace fp8_detail;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int warp_m = warp >> 2;  // tokens warp_m * 64 .. +64
  const int warp_n = warp & 3;   // weight rows warp_n * 32 .. +32
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kBn;
  const int64_t tok0 = static_cast<int64_t>(blockIdx.y) * kBm;
  const int num_kt = static_cast<int>((p.k + kBk - 1) / kBk);
  const float* srow = p.scale_inv + (row0 / kFp8Block) * p.kb_count;

  float acc[4][4][4], part[4][4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[a][b][i] = part[a][b][i] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_kt) load_stage<kVec>(p, smem + s * kStageBytes, tok0, row0, static_cast<int64_t>(s) * kBk);
    ptx::cp_async_commit();
  }

  for (int kt = 0; kt < num_kt; ++kt) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt landed; stage kt-1 is free
    {
      const int nk = kt + kStages - 1;
      if (nk < num_kt)
        load_stage<kVec>(p, smem + (nk % kStages) * kStageBytes, tok0, row0, static_cast<int64_t>(nk) * kBk);
      ptx::cp_async_commit();
    }
    const uint8_t* stage = smem + (kt % kStages) * kStageBytes;
    const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(stage);
    const uint8_t* ws = stage + kXStageBytes;
#pragma unroll
    for (int ks = 0; ks < kBk / 16; ++ks) {
      uint32_t a[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int r = warp_m * 64 + mt * 16 + g;
        const uint2 lo = *reinterpret_cast<const uint2*>(xs + r * kXRow + ks * 16 + 4 * q);
        const uint2 hi = *reinterpret_cast<const uint2*>(xs + (r + 8) * kXRow + ks * 16 + 4 * q);
        a[mt][0] = lo.x;
        a[mt][2] = lo.y;
        a[mt][1] = hi.x;
        a[mt][3] = hi.y;
      }
      uint32_t b[4][2];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int r = warp_n * 32 + nt * 8 + g;
        const uint32_t wv = *reinterpret_cast<const uint32_t*>(ws + r * kWRow + ks * 16 + 4 * q);
        e4m3x4_to_bf16x4(wv, b[nt][0], b[nt][1]);
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) ptx::mma_m16n8k16_bf16(part[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
    const bool block_end = ((kt + 1) * kBk) % kFp8Block == 0 || kt == num_kt - 1;
    if (block_end) {
      const float s = __ldg(srow + (static_cast<int64_t>(kt) * kBk) / kFp8Block);
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[a][b][i] = fmaf(part[a][b][i], s, acc[a][b][i]);
            part[a][b][i] = 0.0f;
          }
    }
  }
  ptx::cp_async_wait<0>();

  // Lane (g, q): tokens warp_m*64 + 16mt + g (+8 for i >= 2), rows
  // warp_n*32 + 8nt + 2q (+1 for odd i).
  Out* out = static_cast<Out*>(p.out);
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t t = tok0 + warp_m * 64 + mt * 16 + g + (i >= 2 ? 8 : 0);
        const int64_t r = row0 + warp_n * 32 + nt * 8 + 2 * q + (i & 1);
        if (t < p.m && r < p.n) store_out<Out>(out + t * p.out_stride + r, acc[mt][nt][i], p.accumulate);
      }
}

template <bool kVec, typename Out>
cudaError_t launch_tiled(const TiledParams& p, cudaStream_t stream) {
  const cudaError_t attr = cuda_common::once_per_device([] {
    return cudaFuncSetAttribute(fp8_tiled_kernel<kVec, Out>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  });
  if (attr != cudaSuccess) return attr;
  const dim3 grid(static_cast<unsigned>((p.n + kBn - 1) / kBn), static_cast<unsigned>((p.m + kBm - 1) / kBm));
  fp8_tiled_kernel<kVec, Out><<<grid, kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fp8_gemm_tiled(const Fp8GemmArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  if ((a.m + kBm - 1) / kBm > 65535) return cudaErrorInvalidValue;
  TiledParams p{};
  p.x = a.x;
  p.x_stride = a.x_stride;
  p.m = a.m;
  p.w = a.w;
  p.scale_inv = a.scale_inv;
  p.n = a.n;
  p.k = a.k;
  p.kb_count = (a.k + kFp8Block - 1) / kFp8Block;
  p.out = a.out;
  p.out_stride = a.out_stride;
  p.accumulate = a.accumulate;
  const bool vec = a.k % 16 == 0 && a.x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(a.w) % 16 == 0;
  if (a.out_dtype == DType::kF32)
    return vec ? launch_tiled<true, float>(p, stream) : launch_tiled<false, float>(p, stream);
  if (a.out_dtype == DType::kBF16)
    return vec ? launch_tiled<true, __nv_bfloat16>(p, stream) : launch_tiled<false, __nv_bfloat16>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace nucleus::kernels
