#include <climits>
#include <cmath>

#include "kernels/sampling/sampling.cuh"

namespace nucleus::kernels {

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kCap = 4096;                   // candidates sorted in shared memory
constexpr int kPerThread = kCap / kThreads;  // candidates per thread in the scans
constexpr int kMaxDigits = 2048;             // 11-bit digits
constexpr int kDigitsPerThread = kMaxDigits / kThreads;
constexpr int kNumPasses = 6;
constexpr uint32_t kIdMask = (1u << 24) - 1;
constexpr double kMassUnits = 2147483648.0;  // fixed-point masses: p / total * 2^31

// ---- keys: (ordered logit bits << 32) | (kIdMask - id); larger = earlier ----

__device__ __forceinline__ uint32_t ordered_bits(float l) {
  uint32_t b = __float_as_uint(l);
  if (b == 0x80000000u) b = 0;  // -0 == +0 (the CPU compares values)
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ uint64_t key_of(float l, int id) {
  return (static_cast<uint64_t>(ordered_bits(l)) << 32) | (kIdMask - static_cast<uint32_t>(id));
}

__device__ __forceinline__ int id_of(uint64_t key) { return static_cast<int>(kIdMask - static_cast<uint32_t>(key)); }

__device__ __forceinline__ float logit_of(uint64_t key) {
  const uint32_t o = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// Radix passes over the key: digit = bits [shift, shift + bits). Bits 24..31
// are always zero (ids < 2^24) and skipped.
__device__ __forceinline__ void pass_digits(int pass, int* shift, int* bits) {
  switch (pass) {
    case 0: *shift = 53; *bits = 11; break;
    case 1: *shift = 42; *bits = 11; break;
    case 2: *shift = 32; *bits = 10; break;
    case 3: *shift = 16; *bits = 8; break;
    case 4: *shift = 8; *bits = 8; break;
    default: *shift = 0; *bits = 8; break;
  }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ double counter_uniform(uint64_t seed, uint64_t counter) {
  const uint64_t bits = splitmix64(seed ^ splitmix64(counter));
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);  // 53 bits, as on the CPU
}

// ---- shared memory and block primitives ----

struct Shared {
  union {
    struct {
      uint32_t cnt[kMaxDigits];
      uint32_t mass[kMaxDigits];
    } hist;
    uint64_t cand[kCap];
  } u;
  double scratch_d[kWarps];
  uint64_t scratch_u[kWarps];
  float scratch_m[kWarps];
  int scratch_i[kWarps];
  int cross_pos, last_pos, last_pos_cnt, n_cand;
  int sel_digit;
  uint64_t sel_above_cnt, sel_above_q, sel_bucket_cnt;
  int cross_j, last_j;
  double cross_cum;
  float row_max;
  int row_argmax;
  double row_sum;
};

__device__ __forceinline__ double block_sum(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double t = lane < kWarps ? scratch[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

// Exclusive prefix sum over the block in thread order; *total gets the sum.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  T excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = T(0);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    T w = lane < kWarps ? scratch[lane] : T(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kWarps) scratch[lane] = w;  // inclusive scan of the warp totals
  }
  __syncthreads();
  *total = scratch[kWarps - 1];
  return (warp > 0 ? scratch[warp - 1] : T(0)) + excl;
}

// Calls f(id, logit) for the row's elements; each thread sees increasing ids.
// kUnroll float4 loads are in flight per thread: one at a time leaves a
// 1024-thread block latency-bound (~15 GB/s per row).
template <typename F>
__device__ __forceinline__ void for_each_logit(const float* __restrict__ row, int vocab, F&& f) {
  constexpr int kUnroll = 4;
  int start = 0;
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const int n4 = vocab >> 2;
    const float4* r4 = reinterpret_cast<const float4*>(row);
    int j = threadIdx.x;
    for (; j + (kUnroll - 1) * kThreads < n4; j += kUnroll * kThreads) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(r4 + j + u * kThreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = 4 * (j + u * kThreads);
        f(i, v[u].x);
        f(i + 1, v[u].y);
        f(i + 2, v[u].z);
        f(i + 3, v[u].w);
      }
    }
    for (; j < n4; j += kThreads) {
      const float4 v = __ldg(r4 + j);
      f(4 * j, v.x);
      f(4 * j + 1, v.y);
      f(4 * j + 2, v.z);
      f(4 * j + 3, v.w);
    }
    start = n4 * 4;
  }
  for (int i = start + threadIdx.x; i < vocab; i += kThreads) f(i, __ldg(row + i));
}

// Descending bitonic sort of cand[0, n), n <= kCap (padded with key 0, below any real key).
__device__ void sort_candidates(Shared& sm, int n) {
  uint64_t* a = sm.u.cand;
  int np = 1;
  while (np < n) np <<= 1;
  for (int i = n + threadIdx.x; i < np; i += kThreads) a[i] = 0;
  __syncthreads();
  for (int k = 2; k <= np; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < np; i += kThreads) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const uint64_t x = a[i], y = a[ixj];
          const bool descending = (i & k) == 0;
          if (descending ? (x < y) : (x > y)) {
            a[i] = y;
            a[ixj] = x;
          }
        }
      }
      __syncthreads();
    }
  }
}

// ---- per-row statistics: max, argmax (first), log-sum-exp ----

struct RowStats {
  float max;
  int argmax;
  double log_z;
};

__device__ __forceinline__ void merge_stats(float& m, int& idx, double& s, float m2, int i2, double s2) {
  const float mn = fmaxf(m, m2);
  const int in = m > m2 ? idx : (m2 > m ? i2 : min(idx, i2));
  const double a = m == -INFINITY ? 0.0 : s * exp(static_cast<double>(m) - mn);
  const double b = m2 == -INFINITY ? 0.0 : s2 * exp(static_cast<double>(m2) - mn);
  m = mn;
  idx = in;
  s = a + b;
}

__device__ RowStats row_stats(const float* row, int vocab, Shared& sm) {
  float m = -INFINITY, s = 0.0f;
  int idx = INT_MAX;
  for_each_logit(row, vocab, [&](int i, float l) {
    if (l > m) {  // strict: the first maximum wins (m = -inf: s = 0 * 0 + 1)
      s = s * expf(m - l) + 1.0f;
      m = l;
      idx = i;
    } else if (l != -INFINITY) {
      s += expf(l - m);
    }
  });
  double sd = s;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
    const double s2 = __shfl_xor_sync(0xffffffffu, sd, o);
    merge_stats(m, idx, sd, m2, i2, s2);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sm.scratch_m[warp] = m;
    sm.scratch_i[warp] = idx;
    sm.scratch_d[warp] = sd;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < kWarps ? sm.scratch_m[lane] : -INFINITY;
    idx = lane < kWarps ? sm.scratch_i[lane] : INT_MAX;
    sd = lane < kWarps ? sm.scratch_d[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
      const double s2 = __shfl_xor_sync(0xffffffffu, sd, o);
      merge_stats(m, idx, sd, m2, i2, s2);
    }
    if (lane == 0) {
      sm.row_max = m;
      sm.row_argmax = idx;
      sm.row_sum = sd;
    }
  }
  __syncthreads();
  // All -inf: no element beat the initial -inf; the CPU's max_element gives id 0.
  const int argmax = sm.row_argmax == INT_MAX ? 0 : sm.row_argmax;
  return {sm.row_max, argmax, static_cast<double>(sm.row_max) + log(sm.row_sum)};
}

// ---- selection ----

// Temperature context. prob(): the CPU's p = exp(l / T - l_max / T) in f64;
// prob_f(): the f32 version used over whole rows (totals, histograms, the
// exact mass above a gathered bucket).
struct Temp {
  float max;
  float inv_t_f;
  double inv_t;
  double cmax;
  __device__ double prob(uint64_t key) const { return exp(static_cast<double>(logit_of(key)) * inv_t - cmax); }
  __device__ float prob_f(float l) const { return expf((l - max) * inv_t_f); }
};

struct Selection {
  int n;                 // sorted candidates in cand[0, n)
  double offset;         // mass (prob_f) of the set above cand[0]; 0 when the whole prefix was gathered
  uint64_t count_above;  // elements of the set above cand[0]; 0 when the whole prefix was gathered
};

// Among the set {key >= lb}, in decreasing key order, finds the bucket where
// the running measure (count, or fixed-point mass prob_f * q_scale) first
// reaches `target` (ge) or exceeds it (!ge). Gathers into cand, sorted, either
// everything of the set at or above that bucket (when at most kCap) or the
// bucket alone (offset/count_above then describe what lies above it) unless
// `need_whole` (a count target <= kCap: passes go on until the prefix fits).
__device__ Selection radix_select(const float* row, int vocab, const Temp& t, uint64_t lb, bool by_mass,
                                  double target, bool ge, float q_scale, bool need_whole, Shared& sm) {
  uint64_t prefix = 0, above_cnt = 0, above_q = 0;
  int fixed_shift = 64;
  for (int pass = 0; pass < kNumPasses; ++pass) {
    int shift, bits;
    pass_digits(pass, &shift, &bits);
    const int num_digits = 1 << bits;
    const uint32_t digit_mask = static_cast<uint32_t>(num_digits - 1);
    __syncthreads();  // cand / hist / sel_* of the previous step are read
    for (int i = threadIdx.x; i < num_digits; i += kThreads) {
      sm.u.hist.cnt[i] = 0;
      sm.u.hist.mass[i] = 0;
    }
    if (threadIdx.x == 0) {
      sm.cross_pos = INT_MAX;
      sm.last_pos = -1;
      sm.last_pos_cnt = -1;
      sm.n_cand = 0;
    }
    __syncthreads();
    for_each_logit(row, vocab, [&](int i, float l) {
      const uint64_t k = key_of(l, i);
      if (k < lb) return;
      if (fixed_shift < 64 && (k >> fixed_shift) != (prefix >> fixed_shift)) return;
      const uint32_t d = static_cast<uint32_t>(k >> shift) & digit_mask;
      atomicAdd(&sm.u.hist.cnt[d], 1u);
      if (by_mass) atomicAdd(&sm.u.hist.mass[d], __float2uint_rn(t.prob_f(l) * q_scale));
    });
    __syncthreads();
    // Thread i owns positions [i * kDigitsPerThread, (i + 1) * kDigitsPerThread)
    // in decreasing digit order (position x is digit num_digits - 1 - x).
    const int pos0 = static_cast<int>(threadIdx.x) * kDigitsPerThread;
    uint64_t c[kDigitsPerThread], q[kDigitsPerThread], c_sum = 0, q_sum = 0;
#pragma unroll
    for (int e = 0; e < kDigitsPerThread; ++e) {
      const int d = num_digits - 1 - (pos0 + e);
      c[e] = d >= 0 ? sm.u.hist.cnt[d] : 0;
      q[e] = by_mass && d >= 0 ? sm.u.hist.mass[d] : 0;
      c_sum += c[e];
      q_sum += q[e];
    }
    uint64_t total_unused;
    const uint64_t cnt_excl = above_cnt + block_exclusive_scan<uint64_t>(c_sum, sm.scratch_u, &total_unused);
    uint64_t q_excl = 0;
    if (by_mass) q_excl = above_q + block_exclusive_scan<uint64_t>(q_sum, sm.scratch_u, &total_unused);
    {
      uint64_t cum = by_mass ? q_excl : cnt_excl;
      int cross = INT_MAX, last = -1, last_cnt = -1;
#pragma unroll
      for (int e = 0; e < kDigitsPerThread; ++e) {
        const uint64_t m = by_mass ? q[e] : c[e];
        cum += m;
        const double x = static_cast<double>(cum);
        if (m > 0 && cross == INT_MAX && (ge ? x >= target : x > target)) cross = pos0 + e;
        if (m > 0) last = pos0 + e;
        if (c[e] > 0) last_cnt = pos0 + e;
      }
      if (cross != INT_MAX) atomicMin(&sm.cross_pos, cross);
      if (last >= 0) atomicMax(&sm.last_pos, last);
      if (last_cnt >= 0) atomicMax(&sm.last_pos_cnt, last_cnt);
    }
    __syncthreads();
    // No crossing (the target is at or past the end, by rounding): the last
    // bucket with mass, else the last non-empty one.
    int pos = sm.cross_pos;
    if (pos == INT_MAX) pos = sm.last_pos >= 0 ? sm.last_pos : sm.last_pos_cnt;
    if (pos < 0) pos = 0;  // empty set: cannot happen (the set holds lb's element)
    if (pos >= pos0 && pos < pos0 + kDigitsPerThread) {
      uint64_t ac = cnt_excl, aq = q_excl, bc = 0;
#pragma unroll
      for (int e = 0; e < kDigitsPerThread; ++e) {
        if (pos0 + e < pos) {
          ac += c[e];
          aq += q[e];
        } else if (pos0 + e == pos) {
          bc = c[e];
        }
      }
      sm.sel_digit = num_digits - 1 - pos;
      sm.sel_above_cnt = ac;
      sm.sel_above_q = aq;
      sm.sel_bucket_cnt = bc;
    }
    __syncthreads();
    prefix |= static_cast<uint64_t>(sm.sel_digit) << shift;
    fixed_shift = shift;
    above_cnt = sm.sel_above_cnt;
    above_q = sm.sel_above_q;
    const uint64_t bucket_cnt = sm.sel_bucket_cnt;
    const bool whole = above_cnt + bucket_cnt <= kCap;
    if (!whole && (need_whole || bucket_cnt > kCap) && pass + 1 < kNumPasses) continue;

    // Gather (hist is dead from here; cand aliases it).
    const uint64_t bucket = prefix >> shift;
    double offset = 0.0;
    for_each_logit(row, vocab, [&](int i, float l) {
      const uint64_t k = key_of(l, i);
      if (k < lb) return;
      const uint64_t hi = k >> shift;
      if (hi < bucket) return;
      if (hi > bucket && !whole) {
        offset += t.prob_f(l);
        return;
      }
      const int slot = atomicAdd(&sm.n_cand, 1);
      if (slot < kCap) sm.u.cand[slot] = k;
    });
    offset = block_sum(offset, sm.scratch_d);  // also orders n_cand and cand
    const int n = min(sm.n_cand, kCap);
    sort_candidates(sm, n);
    return {n, whole ? 0.0 : offset, whole ? 0 : above_cnt};
  }
  return {0, 0.0, 0};  // not reached: the last pass always gathers
}

struct Crossing {
  int j;         // index into cand
  double cum;    // offset + mass of cand[0..j]
  double total;  // offset + mass of cand[0..n)
};

// Over the sorted cand[0, n): the first j with offset + sum(prob(cand[0..j]))
// >= target (ge) or > target (!ge), among candidates of positive mass; the
// last candidate of positive mass when none (rounding); n - 1 when none has mass.
__device__ Crossing find_crossing(const Temp& t, int n, double offset, double target, bool ge, Shared& sm) {
  const uint64_t* cand = sm.u.cand;
  const int per = (n + kThreads - 1) / kThreads;  // <= kPerThread
  const int begin = static_cast<int>(threadIdx.x) * per;
  double pr[kPerThread];
  double local = 0.0;
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) {
    const int idx = begin + e;
    pr[e] = (e < per && idx < n) ? t.prob(cand[idx]) : 0.0;
    local += pr[e];
  }
  __syncthreads();  // cross_j / cross_cum of a previous call are read
  if (threadIdx.x == 0) {
    sm.cross_j = INT_MAX;
    sm.last_j = -1;
  }
  double total;
  const double base = offset + block_exclusive_scan<double>(local, sm.scratch_d, &total);
  double cum = base;
  bool found = false;
  int last = -1;
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) {
    const int idx = begin + e;
    if (e < per && idx < n && pr[e] > 0.0) {
      cum += pr[e];
      if (!found && (ge ? cum >= target : cum > target)) {
        atomicMin(&sm.cross_j, idx);
        found = true;
      }
      last = idx;
    }
  }
  if (last >= 0) atomicMax(&sm.last_j, last);
  __syncthreads();
  int j = sm.cross_j;
  if (j == INT_MAX) j = sm.last_j >= 0 ? sm.last_j : n - 1;
  if (j >= begin && j < begin + per) {
    double c = base;
#pragma unroll
    for (int e = 0; e < kPerThread; ++e)
      if (begin + e <= j) c += pr[e];
    sm.cross_cum = c;
  }
  __syncthreads();
  return {j, sm.cross_cum, offset + total};
}

__device__ double total_mass(const float* row, int vocab, const Temp& t, Shared& sm) {
  double s = 0.0;
  for_each_logit(row, vocab, [&](int, float l) { s += t.prob_f(l); });
  return block_sum(s, sm.scratch_d);
}

// A sampled row's token (temperature > 0).
__device__ int sample_row(const float* row, int vocab, const SampleRowParams& p, const RowStats& st, Shared& sm) {
  Temp t;
  t.max = st.max;
  t.inv_t = 1.0 / static_cast<double>(p.temperature);
  t.inv_t_f = static_cast<float>(t.inv_t);
  t.cmax = static_cast<double>(st.max) * t.inv_t;
  const double u = counter_uniform(p.seed, p.output_index);
  const int k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  if (k == 1) return st.argmax;

  if (k <= kCap) {  // the whole top-k set sorted in shared memory: the CPU's computation
    const Selection s = radix_select(row, vocab, t, 0, false, k, true, 0.0f, true, sm);
    if (s.n < k) return st.argmax;  // cannot happen
    const Crossing all = find_crossing(t, k, 0.0, INFINITY, true, sm);
    int keep = k;
    double kept = all.total;
    if (p.top_p < 1.0f) {
      const Crossing c = find_crossing(t, k, 0.0, static_cast<double>(p.top_p) * all.total, true, sm);
      keep = c.j + 1;
      kept = c.cum;
    }
    const Crossing d = find_crossing(t, keep, 0.0, u * kept, false, sm);
    return id_of(sm.u.cand[d.j]);
  }

  // Large candidate sets: select by count (top-k), then by mass (top-p, draw).
  uint64_t lb = 0;
  double total;
  if (k < vocab) {
    const Selection s = radix_select(row, vocab, t, 0, false, k, true, 0.0f, false, sm);
    const int j = k - 1 - static_cast<int>(s.count_above);  // the k-th element within the bucket
    if (j < 0 || j >= s.n) return st.argmax;                  // cannot happen
    total = find_crossing(t, j + 1, s.offset, INFINITY, true, sm).total;
    lb = sm.u.cand[j];
  } else {
    total = total_mass(row, vocab, t, sm);
  }
  const float q_scale = static_cast<float>(kMassUnits / total);
  double kept = total;
  if (p.top_p < 1.0f) {
    const double x = static_cast<double>(p.top_p) * total;
    const Selection s = radix_select(row, vocab, t, lb, true, p.top_p * kMassUnits, true, q_scale, false, sm);
    if (s.n == 0) return st.argmax;  // cannot happen
    const Crossing c = find_crossing(t, s.n, s.offset, x, true, sm);
    kept = c.cum;
    const double x2 = u * kept;
    if (x2 >= s.offset) {  // the draw lands among the gathered candidates
      const Crossing d = find_crossing(t, c.j + 1, s.offset, x2, false, sm);
      return id_of(sm.u.cand[d.j]);
    }
    lb = sm.u.cand[c.j];
  }
  const double x2 = u * kept;
  const Selection s = radix_select(row, vocab, t, lb, true, x2 / total * kMassUnits, false, q_scale, false, sm);
  if (s.n == 0) return st.argmax;  // cannot happen
  const Crossing d = find_crossing(t, s.n, s.offset, x2, false, sm);
  return id_of(sm.u.cand[d.j]);
}

__global__ void __launch_bounds__(kThreads, 1)
    sample_rows_kernel(const float* __restrict__ logits, const float* __restrict__ adjusted, int vocab,
                       const SampleRowParams* __restrict__ params, SampleRowResult* __restrict__ results) {
  __shared__ Shared sm;
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  const SampleRowParams p = params[blockIdx.x];
  SampleRowResult* out = results + blockIdx.x;
  const RowStats st = row_stats(row, vocab, sm);  // raw: logprobs
  // The row the token is drawn from: the adjusted copy when there is one.
  const float* draw = row;
  RowStats dst = st;
  if (p.adjusted_row >= 0 && adjusted != nullptr) {
    draw = adjusted + static_cast<int64_t>(p.adjusted_row) * vocab;
    dst = row_stats(draw, vocab, sm);
  }
  int token = dst.argmax;  // greedy, or no finite logit left (token 0)
  if (p.temperature != 0.0f && dst.max != -INFINITY) token = sample_row(draw, vocab, p, dst, sm);
  if (threadIdx.x == 0) {
    out->token = token;
    out->logprob = static_cast<float>(static_cast<double>(row[token]) - st.log_z);
  }
  const int n_top = max(0, min(p.num_logprobs, min(vocab, kMaxSampleLogprobs)));
  if (n_top > 0) {
    Temp t{st.max, 1.0f, 1.0, static_cast<double>(st.max)};
    radix_select(row, vocab, t, 0, false, n_top, true, 0.0f, true, sm);  // whole prefix: n >= n_top
    if (threadIdx.x < n_top) {
      const uint64_t key = sm.u.cand[threadIdx.x];
      out->top_ids[threadIdx.x] = id_of(key);
      out->top_logprobs[threadIdx.x] = static_cast<float>(static_cast<double>(logit_of(key)) - st.log_z);
    }
  }
  if (threadIdx.x == 0) out->num_top = n_top;
}

// One block per adjusted row: copy, sparse entries, then min_p (a max over
// the adjusted row and a masking pass). The output row is read back with
// plain loads (not __ldg: it is written by this kernel).
__global__ void __launch_bounds__(kThreads, 1)
    adjust_rows_kernel(const float* __restrict__ logits, int vocab, const AdjustRowParams* __restrict__ rows,
                       const TokenAdjustment* __restrict__ entries, float* __restrict__ adjusted) {
  __shared__ float red[kWarps];
  const AdjustRowParams p = rows[blockIdx.x];
  const float* src = logits + static_cast<int64_t>(p.src_row) * vocab;
  float* dst = adjusted + static_cast<int64_t>(blockIdx.x) * vocab;
  for_each_logit(src, vocab, [&](int i, float l) { dst[i] = l; });
  __syncthreads();  // the copy's writes land before the entries' (same ids)
  for (int j = threadIdx.x; j < p.num_entries; j += kThreads) {
    const TokenAdjustment e = entries[p.first_entry + j];
    dst[e.id] = adjust_logit(__ldg(src + e.id), e, p.penalties);
  }
  if (!(p.min_p > 0.0f && p.temperature != 0.0f)) return;
  __syncthreads();  // the entries' writes are visible to the block
  float m = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += kThreads) m = fmaxf(m, dst[i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red[w]);
  if (m == -INFINITY) return;  // nothing finite: the sampler returns token 0, as the CPU does
  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  const double cmax = static_cast<double>(m) * inv_t;
  for (int i = threadIdx.x; i < vocab; i += kThreads)
    if (!keep_min_p(dst[i], inv_t, cmax, p.min_p)) dst[i] = -INFINITY;
}

__global__ void counter_uniform_kernel(const uint64_t* seeds, const uint64_t* counters, int64_t n, double* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = counter_uniform(seeds[i], counters[i]);
}

}  // namespace

cudaError_t launch_sample_rows(const float* logits, const float* adjusted, int64_t num_rows, int64_t vocab,
                               const SampleRowParams* params, SampleRowResult* results, cudaStream_t stream) {
  if (vocab < 1 || vocab > kMaxSampleVocab || num_rows < 0 || num_rows > INT_MAX) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  sample_rows_kernel<<<static_cast<unsigned>(num_rows), kThreads, 0, stream>>>(
      logits, adjusted, static_cast<int>(vocab), params, results);
  return cudaGetLastError();
}

cudaError_t launch_adjust_rows(const float* logits, int64_t vocab, int64_t num_adjusted, const AdjustRowParams* rows,
                               const TokenAdjustment* entries, float* adjusted, cudaStream_t stream) {
  if (vocab < 1 || vocab > kMaxSampleVocab || num_adjusted < 0 || num_adjusted > INT_MAX) return cudaErrorInvalidValue;
  if (num_adjusted == 0) return cudaSuccess;
  adjust_rows_kernel<<<static_cast<unsigned>(num_adjusted), kThreads, 0, stream>>>(
      logits, static_cast<int>(vocab), rows, entries, adjusted);
  return cudaGetLastError();
}

cudaError_t launch_counter_uniform(const uint64_t* seeds, const uint64_t* counters, int64_t n, double* out,
                                   cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  counter_uniform_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(seeds, counters, n, out);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
