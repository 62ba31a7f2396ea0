// FP8 block-scaled GEMM for small m (decode): memory-bound, so each weight
// byte is read once from DRAM and converted to bf16 in registers right before
// its mma.sync.
//
// The weights are the MMA's A operand (16 weight rows x 16 k), the tokens its
// B operand (16 k x 8 tokens). A lane's 16 bytes of one weight row cover k =
// chunk + 16q .. +16 (q = lane % 4); the MMA's k slots are permuted so that
// the 4 bytes of word t feed MMA t of the chunk: slots {2q, 2q+1} <-> k =
// chunk + 16q + 4t + {0, 1}, slots {2q+8, 2q+9} <-> +{2, 3}. A and B use the
// same permutation, so the sum is unchanged; the x fragment is then one 8-byte
// load of 4 consecutive bf16.
//
// Bytes in flight: a warp streams its 32 rows through a 2-stage shared-memory
// ring, a stage being 256 k (two scale blocks, 8 KB) of all its rows, loaded
// with cp.async so that each half-warp reads 256 contiguous bytes of one row
// (long DRAM runs; no registers held by loads in flight). A stage is refilled
// as soon as the warp has read it, so up to two stages are in flight. The
// 16-byte chunks of a row are XOR-swizzled by (row & 1) << 2 so that the
// fragment reads (2 rows x 64 bytes per quarter-warp) hit distinct banks.
//
// A warp owns 32 weight rows; a CTA (4 warps, 64 KB of ring: 3 CTAs per SM)
// owns 128 rows and a range of 128-wide k blocks (split-K over blockIdx.y),
// the grid sized to one wave of 3 CTAs per SM whatever m is (so a row's sum
// never depends on the batch). Per k block the MMA partial sums are scaled by
// scale_inv once (f32). With splits, each CTA writes its f32 partial to the
// workspace; the last CTA of a row range (atomic counter) adds them in split
// order with all its threads, so results are deterministic.
#include <algorithm>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/gemm/fp8_gemm.cuh"

namespace nucleus::kernels {

namespace {

constexpr int kWarps = 4;
constexpr int kCtasPerSm = 3;  // what the 64 KB ring allows; the grid targets one wave of these

struct DecodeParams {
  const __nv_bfloat16* x;
  int64_t x_stride;
  int m;
  const uint8_t* w;
  const float* scale_inv;
  int n, k, kb_count;
  void* out;
  int64_t out_stride;
  bool accumulate;
  int kb_per_split, splits;
  float* partial;  // [splits, m, n] when splits > 1
  int* counters;   // [gridDim.x]
};

constexpr int kStages = 2;          // ring stages per warp
constexpr int kR = 2;               // 16-row weight tiles per warp
constexpr int kRowsPerWarp = kR * 16;
constexpr int kStageK = 2 * kFp8Block;  // k per stage: two scale blocks
constexpr int kStageBytes = kRowsPerWarp * kStageK;  // 8 KB
constexpr int kSmemBytes = kWarps * kStages * kStageBytes;  // 64 KB

// Byte offset of 16-byte chunk `chunk` (0..15) of ring row `row` (0..31).
__device__ __forceinline__ int ring_offset(int row, int chunk) {
  return row * kStageK + ((chunk ^ ((row & 1) << 2)) << 4);
}

// NT: token tiles of 8 (m <= 8 NT).
template <int NT, typename Out>
__global__ void __launch_bounds__(kWarps * 32, NT <= 2 ? kCtasPerSm : 2) fp8_decode_kernel(const DecodeParams p) {
  using namespace fp8_detail;
  constexpr int R = kR;
  static_assert(kFp8Block % kRowsPerWarp == 0, "a warp's rows must share one scale row");
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int row_base = (blockIdx.x * kWarps + warp) * kRowsPerWarp;
  const int kb_begin = blockIdx.y * p.kb_per_split;
  const int kb_end = min(kb_begin + p.kb_per_split, p.kb_count);
  const bool active = row_base < p.n;
  uint8_t* ring = smem + warp * kStages * kStageBytes;

  float acc[R][NT][4];
  zero_acc(acc);

  if (active) {
    const __nv_bfloat16* xrow[NT];
    bool tvalid[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int t = j * 8 + g;
      tvalid[j] = t < p.m;
      xrow[j] = p.x + static_cast<int64_t>(tvalid[j] ? t : 0) * p.x_stride;
    }
    const float* srow = p.scale_inv + static_cast<int64_t>(row_base / kFp8Block) * p.kb_count;
    const int num_stages = (kb_end - kb_begin + 1) / 2;

    // Stage `st` of this warp's range (blocks kb_begin + 2st, +1) -> ring
    // buffer `buf`: 16 cp.async per lane, a half-warp per row.
    auto issue = [&](int buf, int st) {
      uint8_t* dst = ring + buf * kStageBytes;
      const int chunk = lane & 15;
      const int kb = kb_begin + 2 * st + (chunk >> 3);
      const int kk = (kb_begin + 2 * st) * kFp8Block + chunk * 16;
      const bool kvalid = kb < kb_end && kk < p.k;  // k % 16 == 0: a chunk is all in or all out
#pragma unroll
      for (int i = 0; i < kRowsPerWarp / 2; ++i) {
        const int row = i * 2 + (lane >> 4);
        const int r = row_base + row;
        const bool ok = kvalid && r < p.n;
        ptx::cp_async_16(dst + ring_offset(row, chunk), ok ? p.w + static_cast<int64_t>(r) * p.k + kk : p.w,
                         ok ? 16 : 0);
      }
    };
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      if (st < num_stages) issue(st, st);
      ptx::cp_async_commit();
    }

    for (int st = 0; st < num_stages; ++st) {
      const int buf = st % kStages;
      const uint8_t* src = ring + buf * kStageBytes;
      ptx::cp_async_wait<kStages - 1>();  // this lane's copies of stage st landed (one group per stage)
      __syncwarp();                  // ... and every other lane's
#pragma unroll 1
      for (int hf = 0; hf < 2; ++hf) {  // the stage's two 128-wide blocks
        const int kb = kb_begin + 2 * st + hf;
        uint4 cur[2][R][2];
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int rt = 0; rt < R; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              cur[c][rt][h] = *reinterpret_cast<const uint4*>(src + ring_offset(rt * 16 + h * 8 + g, hf * 8 + c * 4 + q));
        if (hf == 1) {  // the whole stage is in registers: refill it
          __syncwarp();
          if (st + kStages < num_stages) issue(buf, st + kStages);
          ptx::cp_async_commit();
        }
        if (kb >= kb_end) continue;  // the range's last stage may hold one block

        float part[R][NT][4];
#pragma unroll
        for (int rt = 0; rt < R; ++rt)
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[rt][j][e] = 0.0f;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int kk = kb * kFp8Block + c * 64 + q * 16;
          const bool kvalid = kk < p.k;
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            uint32_t b[NT][2];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              if (tvalid[j] && kvalid) {
                const uint2 xv = __ldg(reinterpret_cast<const uint2*>(xrow[j] + kk + 4 * t));
                b[j][0] = xv.x;
                b[j][1] = xv.y;
              } else {
                b[j][0] = b[j][1] = 0u;
              }
            }
#pragma unroll
            for (int rt = 0; rt < R; ++rt) {
              uint32_t a[4];
              e4m3x4_to_bf16x4(word_of(cur[c][rt][0], t), a[0], a[2]);
              e4m3x4_to_bf16x4(word_of(cur[c][rt][1], t), a[1], a[3]);
#pragma unroll
              for (int j = 0; j < NT; ++j) ptx::mma_m16n8k16_bf16(part[rt][j], a, b[j][0], b[j][1]);
            }
          }
        }
        const float sc = __ldg(srow + kb);
#pragma unroll
        for (int rt = 0; rt < R; ++rt)
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[rt][j][e] = fmaf(part[rt][j][e], sc, acc[rt][j][e]);
      }
    }
    ptx::cp_async_wait<0>();
  }

  // Lane (g, q) holds rows row_base + 16rt + g (+8 for i >= 2) and tokens
  // 8j + 2q (+1 for odd i).
  Out* out = static_cast<Out*>(p.out);
  if (p.splits == 1) {
    if (!active) return;
#pragma unroll
    for (int rt = 0; rt < R; ++rt)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = row_base + rt * 16 + g + (i >= 2 ? 8 : 0);
          const int t = j * 8 + 2 * q + (i & 1);
          if (r < p.n && t < p.m) store_out<Out>(out + t * p.out_stride + r, acc[rt][j][i], p.accumulate);
        }
    return;
  }

  if (active) {
    float* part_out = p.partial + static_cast<int64_t>(blockIdx.y) * p.m * p.n;
#pragma unroll
    for (int rt = 0; rt < R; ++rt)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = row_base + rt * 16 + g + (i >= 2 ? 8 : 0);
          const int t = j * 8 + 2 * q + (i & 1);
          if (r < p.n && t < p.m) part_out[static_cast<int64_t>(t) * p.n + r] = acc[rt][j][i];
        }
  }
  __threadfence();  // partials visible device-wide before the count
  __syncthreads();
  __shared__ int s_last;
  if (threadIdx.x == 0) s_last = atomicAdd(&p.counters[blockIdx.x], 1) == p.splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // The last CTA of this row range adds the splits' partials: all threads,
  // consecutive rows per consecutive threads, 8 loads in flight, the sum in
  // split order.
  constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
  const int row0 = blockIdx.x * kRowsPerCta;
  const int64_t split_stride = static_cast<int64_t>(p.m) * p.n;
  for (int e = threadIdx.x; e < p.m * kRowsPerCta; e += blockDim.x) {
    const int t = e / kRowsPerCta, r = row0 + e % kRowsPerCta;
    if (r >= p.n) continue;
    const float* src = p.partial + static_cast<int64_t>(t) * p.n + r;
    float v = 0.0f;
    int s = 0;
    for (; s + 8 <= p.splits; s += 8) {
      float part[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) part[u] = __ldcg(src + (s + u) * split_stride);
#pragma unroll
      for (int u = 0; u < 8; ++u) v += part[u];
    }
    for (; s < p.splits; ++s) v += __ldcg(src + s * split_stride);
    store_out<Out>(out + t * p.out_stride + r, v, p.accumulate);
  }
  if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;  // ready for the next launch
}

int num_sms() {
  static int sms = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v > 0 ? v : 132;
  }();
  return sms;
}

template <int NT, typename Out>
cudaError_t launch_decode(const Fp8GemmArgs& a, const Fp8SplitWorkspace& ws, cudaStream_t stream) {
  DecodeParams p{};
  p.x = a.x;
  p.x_stride = a.x_stride;
  p.m = static_cast<int>(a.m);
  p.w = a.w;
  p.scale_inv = a.scale_inv;
  p.n = static_cast<int>(a.n);
  p.k = static_cast<int>(a.k);
  p.kb_count = static_cast<int>((a.k + kFp8Block - 1) / kFp8Block);
  p.out = a.out;
  p.out_stride = a.out_stride;
  p.accumulate = a.accumulate;
  const int rows_per_cta = kWarps * kRowsPerWarp;
  const int grid_n = static_cast<int>((a.n + rows_per_cta - 1) / rows_per_cta);
  // One wave of kCtasPerSm CTAs per SM (the same for every m); fewer splits
  // when the workspace is short.
  int splits = std::max(1, std::min(p.kb_count, kCtasPerSm * num_sms() / grid_n));
  if (splits > 1) {
    const int64_t by_ws = ws.partial_floats / std::max<int64_t>(1, a.m * a.n);
    if (ws.partial == nullptr || ws.counters == nullptr || grid_n > ws.num_counters) splits = 1;
    else splits = static_cast<int>(std::min<int64_t>(splits, by_ws));
    splits = std::max(splits, 1);
  }
  p.kb_per_split = std::max(1, (p.kb_count + splits - 1) / splits);
  p.kb_per_split += p.kb_per_split % 2;  // whole stages of two blocks
  p.splits = std::max(1, (p.kb_count + p.kb_per_split - 1) / p.kb_per_split);
  p.partial = ws.partial;
  p.counters = ws.counters;
  const cudaError_t attr = cuda_common::once_per_device([] {
    return cudaFuncSetAttribute(fp8_decode_kernel<NT, Out>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  });
  if (attr != cudaSuccess) return attr;
  dim3 grid(grid_n, p.splits);
  fp8_decode_kernel<NT, Out><<<grid, kWarps * 32, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename Out>
cudaError_t launch_decode_for_m(const Fp8GemmArgs& a, const Fp8SplitWorkspace& ws, cudaStream_t stream) {
  if (a.m <= 8) return launch_decode<1, Out>(a, ws, stream);
  if (a.m <= 16) return launch_decode<2, Out>(a, ws, stream);
  if (a.m <= 32) return launch_decode<4, Out>(a, ws, stream);
  return launch_decode<8, Out>(a, ws, stream);
}

}  // namespace

bool fp8_decode_eligible(const Fp8GemmArgs& a) {
  return a.m >= 1 && a.m <= kFp8DecodeMaxRows && a.k % 16 == 0 && a.x_stride % 4 == 0 &&
         reinterpret_cast<uintptr_t>(a.x) % 8 == 0 && reinterpret_cast<uintptr_t>(a.w) % 16 == 0 &&
         a.n < (int64_t{1} << 31) && a.k < (int64_t{1} << 31);
}

cudaError_t launch_fp8_gemm_decode(const Fp8GemmArgs& a, const Fp8SplitWorkspace& ws, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  if (!fp8_decode_eligible(a)) return cudaErrorInvalidValue;
  if (a.out_dtype == DType::kF32) return launch_decode_for_m<float>(a, ws, stream);
  if (a.out_dtype == DType::kBF16) return launch_decode_for_m<__nv_bfloat16>(a, ws, stream);
  return cudaErrorInvalidValue;
}

int64_t fp8_decode_split_counters(int64_t n) {
  const int64_t rows_per_cta = kWarps * kRowsPerWarp;
  return (n + rows_per_cta - 1) / rows_per_cta;
}

int64_t fp8_decode_split_partial_floats(int64_t max_m, int64_t n, int64_t k) {
  return (k + kFp8Block - 1) / kFp8Block * std::min<int64_t>(max_m, kFp8DecodeMaxRows) * n;
}

cudaError_t launch_fp8_gemm(const Fp8GemmArgs& a, const Fp8SplitWorkspace& ws, cudaStream_t stream) {
  if (fp8_decode_eligible(a)) return launch_fp8_gemm_decode(a, ws, stream);
  return launch_fp8_gemm_tiled(a, stream);
}

}  // namespace nucleus::kernels
