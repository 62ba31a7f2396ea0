#include "kernels/common/cuda_common.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/moe/moe_naive.cuh"

namespace nucleus::kernels {

namespace {
using cuda_common::warp_sum;

// A candidate of a warp-wide argmax: the larger value wins, and among equal
// values the lower index (the CPU reference's first-maximum rule); idx < 0 is
// no candidate.
struct Candidate {
  float v;
  int idx;
};

__device__ __forceinline__ bool better(const Candidate& a, const Candidate& b) {
  return a.idx >= 0 && (b.idx < 0 || a.v > b.v || (a.v == b.v && a.idx < b.idx));
}

__device__ __forceinline__ Candidate warp_best(Candidate c) {
  for (int off = 16; off > 0; off >>= 1) {
    Candidate o{__shfl_xor_sync(0xffffffffu, c.v, off), __shfl_xor_sync(0xffffffffu, c.idx, off)};
    if (better(o, c)) c = o;
  }
  return c;
}

constexpr int kRouteWarps = 4;  // tokens per block

// A chosen expert's routing weight from its score w and the sum of the
// top_k chosen scores, as moe_route_ref: normalised (noaux_tc: when
// norm_topk_prob; the others: when norm_topk_prob and top_k > 1), then
// scaled by routed_scaling_factor (noaux_tc always; the others only when not
// normalised). Both router kernels use it.
__device__ __forceinline__ float routed_weight(const MoeRoutingParams& p, float w, float sum) {
  const bool normalise = p.method == TopkMethod::kNoauxTc ? p.norm_topk_prob : (p.top_k > 1 && p.norm_topk_prob);
  const bool scale = p.method == TopkMethod::kNoauxTc || !normalise;
  if (normalise) w /= (sum + 1e-20f);
  if (scale) w *= p.routed_scaling_factor;
  return w;
}

// One warp per token: scores, the group limit and the top-k selection as
// warp-wide argmaxes (lane l owns experts l, l + 32, ...; and groups l, l + 32).
// Same selection rule as moe_route_ref; the softmax sum is a warp reduction,
// so scores may differ from the reference by float rounding.
__global__ void moe_route_kernel(MoeRoutingParams p, const float* __restrict__ logits, const float* __restrict__ bias,
                                 int32_t* __restrict__ topk_ids, float* __restrict__ topk_weights,
                                 int64_t num_tokens) {
  // Wait, then let the dependent launch: the dependent may be the grouped
  // path's UP GEMM (align-free one-token steps), whose CTAs, launched before
  // the router GEMM has drained, measured 3-30 us slower (docs/perf.md "In
  // the graph: the kernel timeline of a batch-1 step").
  pdl::wait_for_inputs();  // launched as a dependent: the router GEMM has finished
  pdl::launch_dependents();
  extern __shared__ float sm[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (t >= num_tokens) return;
  const int E = static_cast<int>(p.num_experts);
  float* scores = sm + static_cast<int64_t>(warp) * 2 * E;  // [E]
  float* choice = scores + E;                                // [E]
  const float* l = logits + t * E;
  if (p.scoring == ScoringFunc::kSoftmax) {
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
    mx = cuda_common::warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) {
      const float v = expf(l[e] - mx);
      scores[e] = v;
      sum += v;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += 32) scores[e] /= sum;
  } else {
    for (int e = lane; e < E; e += 32) scores[e] = 1.0f / (1.0f + expf(-l[e]));
  }
  for (int e = lane; e < E; e += 32) choice[e] = bias ? scores[e] + bias[e] : scores[e];
  __syncwarp();
  const int G = static_cast<int>(p.n_group), gs = E / G;
  if (p.method != TopkMethod::kGreedy && G > 1) {
    float gscore[2] = {-INFINITY, -INFINITY};  // groups lane and lane + 32 (G <= 64)
    for (int j = 0; j < 2; ++j) {
      const int g = lane + 32 * j;
      if (g >= G) continue;
      if (p.method == TopkMethod::kNoauxTc) {
        float a = -INFINITY, b = -INFINITY;  // top-2 of the group
        for (int e = g * gs; e < (g + 1) * gs; ++e) {
          const float c = choice[e];
          if (c > a) { b = a; a = c; } else if (c > b) { b = c; }
        }
        gscore[j] = gs >= 2 ? a + b : a;
      } else {
        for (int e = g * gs; e < (g + 1) * gs; ++e) gscore[j] = fmaxf(gscore[j], choice[e]);
      }
    }
    unsigned long long kept = 0;  // bit g: group g kept
    for (int pick = 0; pick < p.topk_group; ++pick) {
      Candidate c{-INFINITY, -1};
      for (int j = 0; j < 2; ++j) {
        const int g = lane + 32 * j;
        if (g < G && !(kept >> g & 1ull) && better({gscore[j], g}, c)) c = {gscore[j], g};
      }
      c = warp_best(c);
      if (c.idx >= 0) kept |= 1ull << c.idx;
    }
    for (int e = lane; e < E; e += 32)
      if (!(kept >> (e / gs) & 1ull)) choice[e] = -INFINITY;
    __syncwarp();
  }
  uint32_t taken = 0;  // bit j: expert lane + 32 j already selected
  float sum = 0.0f;
  const int64_t slots = p.top_k + p.shared_slots;  // MoeRoutingParams::slots (host-only)
  int32_t* ids = topk_ids + t * slots;
  float* w = topk_weights + t * slots;
  float picked[16];
  const int K = static_cast<int>(p.top_k);
  for (int k = 0; k < K; ++k) {
    Candidate c{-INFINITY, -1};
    for (int j = 0, e = lane; e < E; ++j, e += 32)
      if (!(taken >> j & 1u) && better({choice[e], e}, c)) c = {choice[e], e};
    c = warp_best(c);
    if ((c.idx & 31) == lane) taken |= 1u << (c.idx / 32);
    const float wk = scores[c.idx];
    if (lane == 0) ids[k] = c.idx;
    if (k < 16) picked[k] = wk;
    sum += wk;
  }
  if (lane != 0) return;
  for (int k = 0; k < K; ++k) w[k] = routed_weight(p, picked[k], sum);
  for (int s = 0; s < static_cast<int>(p.shared_slots); ++s) {
    ids[K + s] = E + s;
    w[K + s] = 1.0f;
  }
}

// A float as an unsigned key whose order is the float order (-0 read as +0);
// 0 is below every float's key (-inf's is 0x007fffff), so it marks "no candidate".
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = __float_as_uint(v + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The register path: the same selection as moe_route_kernel (one warp a
// token, lane l owning experts l + 32 j, j < J), with every value in
// registers and each warp-wide argmax two redux.sync instructions (the
// largest key, then the lowest index holding it: the CPU reference's
// first-maximum rule) instead of a five-step shuffle tree over shared
// memory. Groups (noaux_tc, group-limited greedy) need group_size % 32 == 0,
// so that group g is the slots j in [g q, (g + 1) q), q = group_size / 32;
// launch_moe_route sends other shapes to moe_route_kernel.
template <int J>
__global__ void moe_route_regs_kernel(MoeRoutingParams p, const float* __restrict__ logits,
                                      const float* __restrict__ bias, int32_t* __restrict__ topk_ids,
                                      float* __restrict__ topk_weights, int64_t num_tokens) {
  pdl::wait_for_inputs();  // the router GEMM has finished (see moe_route_kernel on the order)
  pdl::launch_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (t >= num_tokens) return;
  const int E = static_cast<int>(p.num_experts);
  const float* l = logits + t * E;
  float score[J], choice[J];
#pragma unroll
  for (int j = 0; j < J; ++j) score[j] = lane + 32 * j < E ? l[lane + 32 * j] : -INFINITY;
  if (p.scoring == ScoringFunc::kSoftmax) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < J; ++j) mx = fmaxf(mx, score[j]);
    mx = cuda_common::warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      score[j] = lane + 32 * j < E ? expf(score[j] - mx) : 0.0f;
      sum += score[j];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < J; ++j) score[j] /= sum;
  } else {
#pragma unroll
    for (int j = 0; j < J; ++j) score[j] = 1.0f / (1.0f + expf(-score[j]));
  }
  uint32_t live = 0;  // bit j: expert lane + 32 j exists and is not yet taken
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane + 32 * j;
    choice[j] = e < E && bias ? score[j] + bias[e] : score[j];
    if (e < E) live |= 1u << j;
  }
  const int G = static_cast<int>(p.n_group);
  if (p.method != TopkMethod::kGreedy && G > 1) {
    const int q = E / G / 32;  // slots a group
    float my_gscore = -INFINITY;  // lane g < G: group g's score
#pragma unroll
    for (int g = 0; g < J; ++g) {
      if (g >= G) continue;  // uniform across the warp
      float a = -INFINITY, b = -INFINITY;  // this lane's top-2 of group g
#pragma unroll
      for (int j = 0; j < J; ++j) {  // the group's slots, j in [g q, (g + 1) q), in order
        if (j / q != g) continue;
        const float c = choice[j];
        if (c > a) { b = a; a = c; } else if (c > b) { b = c; }
      }
      const uint32_t k1 = __reduce_max_sync(0xffffffffu, order_key(a));
      float gs = key_value(k1);
      if (p.method == TopkMethod::kNoauxTc) {
        // The second largest: every lane's best, except one holder of the
        // largest, which offers its second.
        const uint32_t holders = __ballot_sync(0xffffffffu, order_key(a) == k1);
        const bool first = (holders & ((1u << lane) - 1u)) == 0 && (holders >> lane & 1u);
        const uint32_t k2 = __reduce_max_sync(0xffffffffu, order_key(first ? b : a));
        gs = key_value(k1) + key_value(k2);  // a + b, as moe_route_kernel's top-2 sum
      }
      if (lane == g) my_gscore = gs;
    }
    // topk_group groups, each the largest score left (ties: the lower group).
    uint32_t kept = 0;
    bool open = lane < G;
    for (int pick = 0; pick < p.topk_group; ++pick) {
      const uint32_t key = open ? order_key(my_gscore) : 0u;
      const uint32_t top = __reduce_max_sync(0xffffffffu, key);
      if (top == 0) break;
      const unsigned g = __reduce_min_sync(0xffffffffu, key == top ? static_cast<unsigned>(lane) : 32u);
      kept |= 1u << g;
      if (static_cast<unsigned>(lane) == g) open = false;
    }
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (!(kept >> (j / q) & 1u)) choice[j] = -INFINITY;  // still selectable, as in moe_route_kernel
  }
  const int K = static_cast<int>(p.top_k);
  int32_t my_id = -1;
  float my_w = 0.0f, sum = 0.0f;
  for (int k = 0; k < K; ++k) {
    uint32_t best = 0;
    int best_idx = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const uint32_t key = (live >> j & 1u) ? order_key(choice[j]) : 0u;
      if (key > best) { best = key; best_idx = lane + 32 * j; }  // ties keep the lower j
    }
    const uint32_t top = __reduce_max_sync(0xffffffffu, best);
    const int idx = static_cast<int>(__reduce_min_sync(0xffffffffu, static_cast<unsigned>(best == top ? best_idx : 0x7fffffff)));
    float w = 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (lane + 32 * j == idx) {
        w = score[j];
        live &= ~(1u << j);
      }
    const float wk = __shfl_sync(0xffffffffu, w, idx & 31);
    if (lane == k) {
      my_id = idx;
      my_w = wk;
    }
    sum += wk;
  }
  const int64_t slots = p.top_k + p.shared_slots;
  if (lane < K) {
    topk_ids[t * slots + lane] = my_id;
    topk_weights[t * slots + lane] = routed_weight(p, my_w, sum);
  } else if (lane < K + p.shared_slots) {
    topk_ids[t * slots + lane] = E + lane - K;
    topk_weights[t * slots + lane] = 1.0f;
  }
}

// scratch[t*top_k + k, i] = silu(gate_e[i] . x_t) * (up_e[i] . x_t); one warp per (pair, i).
__global__ void expert_up_kernel(const __nv_bfloat16* __restrict__ x, int64_t hidden, int64_t inter,
                                 const int32_t* __restrict__ ids, int64_t top_k, const ExpertView* experts,
                                 float* __restrict__ scratch, int64_t num_pairs) {
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= num_pairs * inter) return;
  const int64_t pair = warp / inter, i = warp % inter;
  const int64_t t = pair / top_k;
  const ExpertView& e = experts[ids[pair]];
  const __nv_bfloat16* xt = x + t * hidden;
  float g = 0.0f, u = 0.0f;
  for (int64_t c = lane; c < hidden; c += 32) {
    const float xv = __bfloat162float(xt[c]);
    g += xv * e.gate_up.at(i, c);
    u += xv * e.gate_up.at(inter + i, c);
  }
  g = warp_sum(g);
  u = warp_sum(u);
  if (lane == 0) scratch[pair * inter + i] = g / (1.0f + expf(-g)) * u;
}

// out[t, c] = sum_k w[t, k] * (down_e[c] . scratch[t*top_k + k]); one warp per (t, c).
__global__ void expert_down_kernel(int64_t num_tokens, int64_t hidden, int64_t inter, const int32_t* __restrict__ ids,
                                   const float* __restrict__ weights, int64_t top_k, const ExpertView* experts,
                                   const float* __restrict__ scratch, __nv_bfloat16* __restrict__ out) {
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= num_tokens * hidden) return;
  const int64_t t = warp / hidden, c = warp % hidden;
  float total = 0.0f;
  for (int64_t k = 0; k < top_k; ++k) {
    const int64_t pair = t * top_k + k;
    const ExpertView& e = experts[ids[pair]];
    const float* h = scratch + pair * inter;
    float acc = 0.0f;
    for (int64_t i = lane; i < inter; i += 32) acc += e.down.at(c, i) * h[i];
    total += weights[pair] * warp_sum(acc);
  }
  if (lane == 0) out[t * hidden + c] = __float2bfloat16(total);
}
}  // namespace

bool moe_route_regs_supported(const MoeRoutingParams& p) {
  const bool grouped = p.method != TopkMethod::kGreedy && p.n_group > 1;
  return p.num_experts >= 1 && p.num_experts <= 32 * kMoeRouteRegsMaxSlots && p.top_k >= 1 &&
         p.top_k <= p.num_experts && (!grouped || (p.num_experts / p.n_group) % 32 == 0);
}

cudaError_t launch_moe_route(const MoeRoutingParams& p, const float* logits, const float* bias, int64_t num_tokens,
                             int32_t* topk_ids, float* topk_weights, cudaStream_t stream, bool dependent,
                             MoeRouteKernel kernel) {
  if (num_tokens == 0) return cudaSuccess;
  if (p.num_experts > 1024 || p.n_group > 64 || p.top_k < 1 || p.top_k > 16 || p.top_k > p.num_experts ||
      p.n_group < 1 || p.num_experts % p.n_group != 0 || p.shared_slots < 0 || p.shared_slots > 16)
    return cudaErrorInvalidValue;
  const auto blocks = static_cast<unsigned>((num_tokens + kRouteWarps - 1) / kRouteWarps);
  const bool regs = kernel != MoeRouteKernel::kSharedMemory && moe_route_regs_supported(p);
  if (kernel == MoeRouteKernel::kRegisters && !regs) return cudaErrorInvalidValue;
  cudaError_t e = cudaSuccess;
  if (regs) {
    const int slots = static_cast<int>((p.num_experts + 31) / 32);
    auto go = [&](auto kern) {
      return pdl::launch(kern, blocks, kRouteWarps * 32, 0, dependent, stream, p, logits, bias, topk_ids,
                         topk_weights, num_tokens);
    };
    e = slots <= 2 ? go(moe_route_regs_kernel<2>)
        : slots <= 4 ? go(moe_route_regs_kernel<4>)
        : slots <= 8 ? go(moe_route_regs_kernel<8>)
                     : go(moe_route_regs_kernel<kMoeRouteRegsMaxSlots>);
  } else {
    const size_t smem = kRouteWarps * 2 * p.num_experts * sizeof(float);
    e = pdl::launch(moe_route_kernel, blocks, kRouteWarps * 32, smem, dependent, stream, p, logits, bias, topk_ids,
                    topk_weights, num_tokens);
  }
  return e != cudaSuccess ? e : cudaGetLastError();
}

cudaError_t launch_moe_experts_naive(const __nv_bfloat16* x, int64_t num_tokens, int64_t hidden, int64_t inter,
                                     const int32_t* topk_ids, const float* topk_weights, int64_t top_k,
                                     const ExpertView* experts, float* scratch, __nv_bfloat16* out,
                                     cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t pairs = num_tokens * top_k;
  expert_up_kernel<<<cuda_common::ceil_div(pairs * inter * 32, 256), 256, 0, stream>>>(x, hidden, inter, topk_ids,
                                                                                      top_k, experts, scratch, pairs);
  expert_down_kernel<<<cuda_common::ceil_div(num_tokens * hidden * 32, 256), 256, 0, stream>>>(
      num_tokens, hidden, inter, topk_ids, topk_weights, top_k, experts, scratch, out);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
