#include "kernels/common/cuda_common.cuh"
#include "kernels/moe/moe_naive.cuh"

namespace nucleus::kernels {

namespace {
using cuda_common::warp_sum;

// One block per token; selection is done by thread 0 over shared arrays
// (num_experts <= 1024, top_k and group counts small).
__global__ void moe_route_kernel(MoeRoutingParams p, const float* __restrict__ logits, const float* __restrict__ bias,
                                 int32_t* __restrict__ topk_ids, float* __restrict__ topk_weights) {
  extern __shared__ float sm[];
  float* scores = sm;                      // [E]
  float* choice = scores + p.num_experts;  // [E]
  __shared__ float red[2];
  const int64_t t = blockIdx.x;
  const int E = static_cast<int>(p.num_experts);
  const float* l = logits + t * E;
  if (p.scoring == ScoringFunc::kSoftmax) {
    if (threadIdx.x == 0) {
      float mx = -INFINITY;
      for (int e = 0; e < E; ++e) mx = fmaxf(mx, l[e]);
      red[0] = mx;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) scores[e] = expf(l[e] - red[0]);
    __syncthreads();
    if (threadIdx.x == 0) {
      float s = 0;
      for (int e = 0; e < E; ++e) s += scores[e];
      red[1] = s;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) scores[e] /= red[1];
  } else {
    for (int e = threadIdx.x; e < E; e += blockDim.x) scores[e] = 1.0f / (1.0f + expf(-l[e]));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) choice[e] = bias ? scores[e] + bias[e] : scores[e];
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int G = static_cast<int>(p.n_group), gs = E / G;
  if (p.method != TopkMethod::kGreedy && G > 1) {
    unsigned long long kept = 0;  // bit g: group g kept (G <= 64)
    for (int pick = 0; pick < p.topk_group; ++pick) {
      int best = -1;
      float best_score = -INFINITY;
      for (int g = 0; g < G; ++g) {
        if (kept >> g & 1ull) continue;
        float gscore;
        if (p.method == TopkMethod::kNoauxTc) {
          float a = -INFINITY, b = -INFINITY;  // top-2
          for (int e = g * gs; e < (g + 1) * gs; ++e) {
            const float c = choice[e];
            if (c > a) { b = a; a = c; } else if (c > b) { b = c; }
          }
          gscore = gs >= 2 ? a + b : a;
        } else {
          gscore = -INFINITY;
          for (int e = g * gs; e < (g + 1) * gs; ++e) gscore = fmaxf(gscore, choice[e]);
        }
        if (best < 0 || gscore > best_score) { best = g; best_score = gscore; }
      }
      kept |= 1ull << best;
    }
    for (int e = 0; e < E; ++e)
      if (!(kept >> (e / gs) & 1ull)) choice[e] = -INFINITY;
  }
  float sum = 0.0f;
  int32_t* ids = topk_ids + t * p.top_k;
  float* w = topk_weights + t * p.top_k;
  for (int k = 0; k < p.top_k; ++k) {
    int best = -1;
    float best_c = -INFINITY;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int j = 0; j < k; ++j) taken |= ids[j] == e;
      if (taken) continue;
      if (best < 0 || choice[e] > best_c) { best = e; best_c = choice[e]; }
    }
    ids[k] = best;
    w[k] = scores[best];
    sum += w[k];
  }
  const bool normalise = p.method == TopkMethod::kNoauxTc ? p.norm_topk_prob : (p.top_k > 1 && p.norm_topk_prob);
  const bool scale = p.method == TopkMethod::kNoauxTc || !normalise;
  for (int k = 0; k < p.top_k; ++k) {
    if (normalise) w[k] /= (sum + 1e-20f);
    if (scale) w[k] *= p.routed_scaling_factor;
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

cudaError_t launch_moe_route(const MoeRoutingParams& p, const float* logits, const float* bias, int64_t num_tokens,
                             int32_t* topk_ids, float* topk_weights, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (p.num_experts > 1024 || p.n_group > 64) return cudaErrorInvalidValue;
  const size_t smem = 2 * p.num_experts * sizeof(float);
  moe_route_kernel<<<static_cast<unsigned>(num_tokens), 128, smem, stream>>>(p, logits, bias, topk_ids, topk_weights);
  return cudaGetLastError();
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
