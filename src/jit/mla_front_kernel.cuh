// The MLA decode front end for a step of W rows, compiled per width through
// NVRTC (jit/mla_front_builds.h) with
//   -DNUCLEUS_WIDTH=W      the build's width (rows at most)
//   -DNUCLEUS_LEAN=0|1     fused (one persistent kernel) or lean (two)
// It computes what this chain of plain kernels computes (deepseek_model.cpp,
// the decode graph's attention block up to the attention itself):
//   A. q_a  = bf16(x . W_qa^T)            [W, Q]      kv_a = bf16(x . W_kva^T)   [W, 576]
//      (without a q LoRA, Q = 0 as in DeepSeek-V2-Lite: q = bf16(x . W_q^T), and B's q_a norm and C are skipped)
//   B. q_a  = bf16(rmsnorm(q_a) * w_qa)   c_kv = bf16(rmsnorm(kv_a[:, :512]) * w_kva)
//      cache[slot] = [c_kv | rope(k_pe)]  (k_pe = kv_a[:, 512:], rotated in f32, rounded once)
//   C. q    = bf16(q_a . W_qb^T)          [W, N * 192]
//   D. q_pe = rope(q_pe) in place; q_full[r, h] = [bf16(q_nope[r, h] . W_UK[h]) | q_pe[r, h]]
// (the rounding points of the plain chain: every GEMM rounds its output to
// bf16 once, f32 accumulation; norms and RoPE in f32; RoPE on interleaved
// pairs, kernels/rope/rope_ref.h.) Stages run on the whole grid and are
// separated by grid barriers, so every CTA of the grid must be resident.
//
// Fused: one kernel, A | B | C | D, every GEMM accumulating all W rows of a
// weight row at once (W f32 accumulators a thread: the weights are read once;
// registers grow with W, which is what makes wide builds spill).
// Lean: two kernels split at the heaviest stage (C, q_b_proj): mla_front_lean_a
// runs A | B, mla_front_lean_b runs C | D, and each GEMM works on tiles of
// NUCLEUS_LEAN_ROWS rows (weights re-read per tile, few registers).
//
// Launch: 256 threads a CTA, a grid of at most the resident CTAs (the runner
// uses one per SM), dynamic shared memory of mla_front_smem_bytes(tile) bytes:
// tile * 128 bf16 (stage D's q_nope of one head).
// Self-contained (no includes beyond the params header) so NVRTC needs no
// CUDA headers.
#include "mla_front_params.h"

#ifndef NUCLEUS_WIDTH
#error "NUCLEUS_WIDTH (the build's width) must be defined"
#endif
#ifndef NUCLEUS_LEAN
#define NUCLEUS_LEAN 0
#endif
#ifndef NUCLEUS_LEAN_ROWS
#define NUCLEUS_LEAN_ROWS 8
#endif
// NUCLEUS_MAX_REGS=N caps registers a thread (the debug knob that forces
// spills; -maxrregcount is ignored where __launch_bounds__ is given).
#ifdef NUCLEUS_MAX_REGS
#define NUCLEUS_FRONT_BOUNDS __maxnreg__(NUCLEUS_MAX_REGS)
#else
#define NUCLEUS_FRONT_BOUNDS __launch_bounds__(256, 1)
#endif

namespace mla_front {

constexpr int kThreads = 256;
constexpr int kLora = 512, kRope = 64, kNope = 128, kQkHead = 192, kLatent = 576, kKvbRowsPerHead = 256;
constexpr int kWidth = NUCLEUS_WIDTH;
constexpr int kTile = NUCLEUS_LEAN ? (kWidth < NUCLEUS_LEAN_ROWS ? kWidth : NUCLEUS_LEAN_ROWS) : kWidth;

__device__ __forceinline__ float bf2f(unsigned short h) { return __uint_as_float(static_cast<unsigned>(h) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {  // round to nearest even, as __float2bfloat16
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ float lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  return lo(a.x) * lo(b.x) + hi(a.x) * hi(b.x) + lo(a.y) * lo(b.y) + hi(a.y) * hi(b.y) + lo(a.z) * lo(b.z) +
         hi(a.z) * hi(b.z) + lo(a.w) * lo(b.w) + hi(a.w) * hi(b.w);
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float block_sum(float v, float* scratch) {  // as kernels/common/cuda_common.cuh
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

// sin and cos of a RoPE angle (pos * inv_freq, the f32 product the plain
// kernel forms). Not sincosf: its slow path for large angles (|x| > ~1e5,
// long contexts) keeps a table in local memory, which would give every build
// a stack frame and so a refusal. The angle is reduced exactly in double and
// sincospi has no slow path; the result can differ from sincosf in the last
// f32 ulp, far below the bf16 rounding that follows.
__device__ __forceinline__ void rope_sincos(float angle, float* s, float* c) {
  double t = static_cast<double>(angle) * 0.31830988618379067154;  // angle / pi
  t -= 2.0 * rint(0.5 * t);
  double sd, cd;
  sincospi(t, &sd, &cd);
  *s = static_cast<float>(sd);
  *c = static_cast<float>(cd);
}

// All CTAs of the grid wait here. bar[0] counts arrivals, bar[1] is the
// generation; the last CTA to arrive resets the count and advances the
// generation, so the state is the same after every barrier (zero count).
__device__ void grid_barrier(unsigned int* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned int* gen = bar + 1;
    const unsigned int g = *gen;
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(bar + 1, 1u);
    } else {
      while (*gen == g) __nanosleep(64);
    }
    __threadfence();
  }
  __syncthreads();
}

// out[r, n] = bf16(sum_k x[r, k] * w[n, k]) for r < rows, n < n_out: one warp
// per output column, lanes over K in 8-element vectors, kTile rows at a time.
// x may have been written earlier in this launch: read through L2 (__ldcg).
__device__ void gemv_rows(const unsigned short* x, long long x_stride, int rows, const unsigned short* w, int k,
                          int n_out, unsigned short* out, long long out_stride) {
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
  const int num_warps = gridDim.x * (kThreads / 32);
  const int k8 = k / 8;
  for (int r0 = 0; r0 < rows; r0 += kTile) {
    for (int n = warp; n < n_out; n += num_warps) {
      float acc[kTile];
#pragma unroll
      for (int t = 0; t < kTile; ++t) acc[t] = 0.0f;
      const uint4* wrow = reinterpret_cast<const uint4*>(w + static_cast<long long>(n) * k);
      for (int i = lane; i < k8; i += 32) {
        const uint4 wv = __ldg(wrow + i);
#pragma unroll
        for (int t = 0; t < kTile; ++t) {
          if (r0 + t < rows) {
            const uint4 xv = __ldcg(reinterpret_cast<const uint4*>(x + (r0 + t) * x_stride) + i);
            acc[t] += dot8(wv, xv);
          }
        }
      }
#pragma unroll
      for (int t = 0; t < kTile; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && r0 + t < rows) out[(r0 + t) * out_stride + n] = f2bf(s);
      }
    }
  }
}

// Stage A: q_a (or, without a q LoRA, q itself: q_proj) and kv_a. One call
// site for either first GEMM (each inlined GEMM costs registers at wide W).
__device__ void stage_a(const MlaFrontParams& p) {
  const bool lora = p.q_lora > 0;
  const int n_q = lora ? p.q_lora : p.num_heads * kQkHead;
  gemv_rows(p.x, p.x_stride, p.rows, lora ? p.w_qa : p.w_qb, p.hidden, n_q, lora ? p.q_a : p.q, n_q);
  gemv_rows(p.x, p.x_stride, p.rows, p.w_kva, p.hidden, kLatent, p.kv_a, kLatent);
}

// x[:width] = bf16(x * rsqrt(mean(x^2) + eps) * w), in place (one CTA).
__device__ void rmsnorm_row(unsigned short* x, int width, const float* w, float eps, float* scratch) {
  float ss = 0.0f;
  for (int i = threadIdx.x; i < width; i += kThreads) {
    const float v = bf2f(__ldcg(x + i));
    ss += v * v;
  }
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(width) + eps);
  for (int i = threadIdx.x; i < width; i += kThreads) x[i] = f2bf(bf2f(__ldcg(x + i)) * inv * w[i]);
}

// Stage B: per row, both norms, then RoPE on k_pe and the cache row.
__device__ void stage_b(const MlaFrontParams& p, float* scratch) {
  for (int r = blockIdx.x; r < p.rows; r += gridDim.x) {
    if (p.q_lora > 0) rmsnorm_row(p.q_a + static_cast<long long>(r) * p.q_lora, p.q_lora, p.qa_norm_w, p.eps, scratch);
    unsigned short* kv = p.kv_a + static_cast<long long>(r) * kLatent;
    rmsnorm_row(kv, kLora, p.kva_norm_w, p.eps, scratch);
    __syncthreads();  // the row's normalised c_kv, written by this CTA's threads
    const long long slot = p.slot_mapping[r];
    if (slot < 0) continue;
    unsigned short* row = p.cache + slot * kLatent;
    const float pos = static_cast<float>(p.positions[r]);
    for (int i = threadIdx.x; i < kRope / 2; i += kThreads) {
      float s, c;
      rope_sincos(pos * p.inv_freq[i], &s, &c);
      c *= p.attention_factor;
      s *= p.attention_factor;
      const float a = bf2f(__ldcg(kv + kLora + 2 * i)), b = bf2f(__ldcg(kv + kLora + 2 * i + 1));
      row[kLora + 2 * i] = f2bf(a * c - b * s);
      row[kLora + 2 * i + 1] = f2bf(b * c + a * s);
    }
    for (int i = threadIdx.x; i < kLora; i += kThreads) row[i] = __ldcg(kv + i);
  }
}

// Stage C: q = bf16(q_a . W_qb^T) (nothing without a q LoRA: stage A made q).
__device__ void stage_c(const MlaFrontParams& p) {
  if (p.q_lora == 0) return;
  gemv_rows(p.q_a, p.q_lora, p.rows, p.w_qb, p.q_lora, p.num_heads * kQkHead, p.q, p.num_heads * kQkHead);
}

// Stage D: per (head, half of the 512 latent columns): RoPE on the head's
// q_pe (first half only) and the absorption q_nope . W_UK[h], one thread per
// latent column, the head's q_nope staged in shared memory kTile rows at a time.
__device__ void stage_d(const MlaFrontParams& p, unsigned short* q_nope_s) {
  const long long q_stride = static_cast<long long>(p.num_heads) * kQkHead;
  const long long out_stride = static_cast<long long>(p.num_heads) * kLatent;
  const int items = p.num_heads * (kLora / kThreads);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int h = item / (kLora / kThreads), j = (item % (kLora / kThreads)) * kThreads + threadIdx.x;
    if (item % (kLora / kThreads) == 0) {
      for (int idx = threadIdx.x; idx < p.rows * (kRope / 2); idx += kThreads) {
        const int r = idx / (kRope / 2), i = idx % (kRope / 2);
        float s, c;
        rope_sincos(static_cast<float>(p.positions[r]) * p.inv_freq[i], &s, &c);
        c *= p.attention_factor;
        s *= p.attention_factor;
        unsigned short* x = p.q + r * q_stride + h * kQkHead + kNope + 2 * i;
        const float a = bf2f(__ldcg(x)), b = bf2f(__ldcg(x + 1));
        const unsigned short ra = f2bf(a * c - b * s), rb = f2bf(b * c + a * s);
        x[0] = ra;
        x[1] = rb;
        unsigned short* o = p.q_full + r * out_stride + h * kLatent + kLora + 2 * i;
        o[0] = ra;
        o[1] = rb;
      }
    }
    const unsigned short* w = p.w_kvb + static_cast<long long>(h) * kKvbRowsPerHead * kLora + j;
    for (int r0 = 0; r0 < p.rows; r0 += kTile) {
      __syncthreads();  // q_nope_s of the previous tile or item is no longer read
      for (int idx = threadIdx.x; idx < kTile * kNope; idx += kThreads) {
        const int t = idx / kNope, d = idx % kNope;
        q_nope_s[idx] = r0 + t < p.rows ? __ldcg(p.q + (r0 + t) * q_stride + h * kQkHead + d) : 0;
      }
      __syncthreads();
      float acc[kTile];
#pragma unroll
      for (int t = 0; t < kTile; ++t) acc[t] = 0.0f;
      for (int d = 0; d < kNope; ++d) {
        const float wv = bf2f(__ldg(w + static_cast<long long>(d) * kLora));
#pragma unroll
        for (int t = 0; t < kTile; ++t) acc[t] += bf2f(q_nope_s[t * kNope + d]) * wv;
      }
#pragma unroll
      for (int t = 0; t < kTile; ++t)
        if (r0 + t < p.rows) p.q_full[(r0 + t) * out_stride + h * kLatent + j] = f2bf(acc[t]);
    }
  }
}

}  // namespace mla_front

#if !NUCLEUS_LEAN
extern "C" __global__ void NUCLEUS_FRONT_BOUNDS mla_front_fused(MlaFrontParams p) {
  extern __shared__ unsigned short smem[];
  __shared__ float scratch[32];
  mla_front::stage_a(p);
  mla_front::grid_barrier(p.barrier);
  mla_front::stage_b(p, scratch);
  mla_front::grid_barrier(p.barrier);
  mla_front::stage_c(p);
  mla_front::grid_barrier(p.barrier);
  mla_front::stage_d(p, smem);
}
#else
extern "C" __global__ void NUCLEUS_FRONT_BOUNDS mla_front_lean_a(MlaFrontParams p) {
  __shared__ float scratch[32];
  mla_front::stage_a(p);
  mla_front::grid_barrier(p.barrier);
  mla_front::stage_b(p, scratch);
}
extern "C" __global__ void NUCLEUS_FRONT_BOUNDS mla_front_lean_b(MlaFrontParams p) {
  extern __shared__ unsigned short smem[];
  mla_front::stage_c(p);
  mla_front::grid_barrier(p.barrier);
  mla_front::stage_d(p, smem);
}
#endif
