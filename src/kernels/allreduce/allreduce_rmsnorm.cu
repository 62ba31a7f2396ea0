#include "kernels/allreduce/allreduce_rmsnorm.cuh"

#include <cstdio>

#include "kernels/common/cuda_common.cuh"
#include "kernels/rmsnorm/add_rmsnorm_row.cuh"

namespace nucleus::kernels {

namespace {

using add_norm_row::kThreads;
constexpr int kVec = 8;  // delta elements per 16-byte load
static_assert(kArMaxWidth == add_norm_row::kMaxWidth);

// One rank's signal buffer. start/end: the flags peers write (slot [cta][peer
// rank]); counter: this rank's last flag per CTA; data: this rank's delta of
// the call in flight, per CTA.
struct Signal {
  uint32_t start[kArMaxBlocks][kArMaxRanks];
  uint32_t end[kArMaxBlocks][kArMaxRanks];
  uint32_t counter[kArMaxBlocks];
  const void* data[kArMaxBlocks];
};

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Thread `peer` of the CTA: tells rank `peer` that this rank reached the
// barrier, then waits until rank `peer` told this rank the same.
__device__ __forceinline__ void barrier_with_peer(Signal* const* signals, int rank, int peer, uint32_t flag,
                                                  bool at_end) {
  Signal* mine = signals[rank];
  Signal* theirs = signals[peer];
  const int b = blockIdx.x;
  store_release_sys(at_end ? &theirs->end[b][rank] : &theirs->start[b][rank], flag);
  const uint32_t* wait = at_end ? &mine->end[b][peer] : &mine->start[b][peer];
  const uint64_t t0 = global_timer_ns();
  while (load_acquire_sys(wait) != flag) {
    if (global_timer_ns() - t0 > kArWaitTimeoutNs) {
      printf("nucleus allreduce_add_rmsnorm: rank %d CTA %d waited 10 s for rank %d (%s barrier, flag %u)\n", rank, b,
             peer, at_end ? "end" : "start", flag);
      __trap();
    }
  }
}

// Eight consecutive delta elements as f32, uncached (a peer rewrites its
// delta between calls). p is 16-byte aligned.
__device__ __forceinline__ void load8_uncached(const __nv_bfloat16* p, float (&v)[kVec]) {
  const uint4 raw = __ldcv(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec; ++k) v[k] = __bfloat162float(h[k]);
}
__device__ __forceinline__ void load8_uncached(const float* p, float (&v)[kVec]) {
  const float4 a = __ldcv(reinterpret_cast<const float4*>(p));
  const float4 b = __ldcv(reinterpret_cast<const float4*>(p + 4));
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// CTAs [0, row_blocks) reduce the rows; the rest (if any) do the prezero fill.
template <typename Delta>
__global__ void __launch_bounds__(kThreads) allreduce_add_rmsnorm_kernel(AllReduceNormParams p, int row_blocks) {
  if (static_cast<int>(blockIdx.x) >= row_blocks) {  // a fill CTA: no signals, no barriers
    add_norm_row::zero_fill_blocks(p.zero_fill, p.zero_fill_count, row_blocks);
    return;
  }
  __shared__ float scratch[32];
  __shared__ uint32_t flag_shared;
  __shared__ const Delta* deltas[kArMaxRanks];
  Signal* const* signals = reinterpret_cast<Signal* const*>(p.signals);
  Signal* mine = signals[p.rank];
  const int b = blockIdx.x;
  if (threadIdx.x == 0) {
    flag_shared = mine->counter[b] + 1;
    mine->data[b] = p.delta;
    __threadfence_system();  // the pointer before the flags that announce it
  }
  __syncthreads();
  const uint32_t flag = flag_shared;
  if (threadIdx.x < p.world_size) {
    barrier_with_peer(signals, p.rank, threadIdx.x, flag, /*at_end=*/false);
    deltas[threadIdx.x] =
        static_cast<const Delta*>(*static_cast<const void* volatile*>(&signals[threadIdx.x]->data[b]));
  }
  __syncthreads();

  // Per row: the ranks' deltas summed in rank order (16-byte loads over
  // NVLink) into shared memory, then the plain add+norm's row code
  // (rmsnorm/add_rmsnorm_row.cuh) reading the sum from there.
  __shared__ float sum[kArMaxWidth];
  const int64_t width = p.width;
  for (int64_t row = b; row < p.rows; row += row_blocks) {
    const int64_t base = row * width;
    __syncthreads();  // the previous row's sum is no longer read
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * kVec; c < width; c += kThreads * kVec) {
      float acc[kVec], d[kVec];
      load8_uncached(deltas[0] + base + c, acc);
      for (int q = 1; q < p.world_size; ++q) {
        load8_uncached(deltas[q] + base + c, d);
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc[k] += d[k];
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) sum[c + k] = acc[k];
    }
    __syncthreads();
    add_norm_row::add_rmsnorm_row(
        p.residual + base, /*has_delta=*/true, [&](int64_t i) { return sum[i]; }, p.weight, width, p.eps,
        p.out + base, scratch);
  }

  __syncthreads();  // every read of the peers' deltas is done
  if (threadIdx.x < p.world_size) barrier_with_peer(signals, p.rank, threadIdx.x, flag, /*at_end=*/true);
  if (threadIdx.x == 0) mine->counter[b] = flag;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

size_t allreduce_signal_bytes() { return sizeof(Signal); }

const char* allreduce_add_rmsnorm_unsupported(const AllReduceNormParams& p) {
  if (p.world_size < 1 || p.world_size > kArMaxRanks) return "world_size outside [1, 8]";
  if (p.rank < 0 || p.rank >= p.world_size) return "rank outside [0, world_size)";
  for (int r = 0; r < p.world_size; ++r)
    if (!p.signals[r]) return "a rank's signal buffer is missing";
  if (p.width % kVec != 0) return "width is not a multiple of 8";
  if (p.width > kArMaxWidth || p.width < 1) return "width outside [1, 8192]";
  if (p.max_blocks < 1 || p.max_blocks > kArMaxBlocks) return "max_blocks outside [1, 64]";
  if (!aligned16(p.delta) || !aligned16(p.residual) || !aligned16(p.out) || !aligned16(p.weight))
    return "a buffer is not 16-byte aligned";
  if (p.zero_fill && p.zero_fill_count > 0 && p.fill_blocks < 1) return "a prezero fill without fill blocks";
  return nullptr;
}

cudaError_t launch_allreduce_add_rmsnorm(const AllReduceNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (allreduce_add_rmsnorm_unsupported(p)) return cudaErrorInvalidValue;
  const int row_blocks = static_cast<int>(p.rows < p.max_blocks ? p.rows : p.max_blocks);
  const bool fill = p.zero_fill != nullptr && p.zero_fill_count > 0;
  const unsigned grid = static_cast<unsigned>(row_blocks + (fill ? p.fill_blocks : 0));
  if (p.delta_f32)
    allreduce_add_rmsnorm_kernel<float><<<grid, kThreads, 0, stream>>>(p, row_blocks);
  else
    allreduce_add_rmsnorm_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p, row_blocks);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
