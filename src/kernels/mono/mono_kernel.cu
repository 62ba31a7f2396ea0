// The decode-program kernel (mono_kernel.cuh). The order every CTA keeps:
//   copy warp:    for each chunk of its queue: wait for the slot to be empty
//                 (its previous round's eight arrivals), announce the bytes on
//                 the slot's full barrier, issue one bulk copy per weight row.
//   compute warps: for each job: wait for its stages, x into shared memory;
//                 for each chunk: wait full, MMAs, arrive empty; per group the
//                 eight warps' sums; then the epilogue; after the CTA's last
//                 job of a stage, one release add of its jobs to the stage's
//                 counter (Program::release_counters; else a fence and an
//                 add a job).
#include "kernels/mono/mono_kernel.cuh"

#include <cuda_bf16.h>

#include <cstdio>

#include "kernels/common/bulk_copy.cuh"
#include "kernels/common/cuda_common.cuh"
#include "kernels/common/device_sms.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemm/fp8_common.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/mla/mla_decode_rows.cuh"

namespace nucleus::kernels::mono {

namespace {

constexpr int kComputeWarps = 8;
constexpr int kThreads = 32 * (1 + kComputeWarps);  // warp 0 copies, warps 1 ... 8 compute
constexpr int kConsumerThreads = kComputeWarps * 32;
static_assert(kComputeWarps * 64 == kSliceK, "each compute warp takes 64 k of a slice");
static_assert(kComputeWarps * kFp8Block == 2 * kSliceK, "each compute warp takes one 128-k scale block of an e4m3 slice");
constexpr int kRowPitch = kSliceK * 2 + 16;         // bytes a weight row takes in a slot (+16: conflict-free ldmatrix)
constexpr int kSlotBytes = kGroupRows * kRowPitch;  // 16,640
constexpr int kMaxSlots = 12, kMinSlots = 3;
constexpr int kRedFloats = 2 * kComputeWarps * 128;            // two buffers of the eight warps' 16 x 8 sums
constexpr int kTileFloats = kMaxWidth * 2 * kMaxTile;           // the job's output tile [row][slot]
static_assert(kTileFloats > kMlaDecodeMaxSplits, "a merge job keeps its split weights and count in the tile");
static_assert(kMaxMergeSplits == kMlaDecodeMaxSplits, "a merge stage takes the splits the attention makes");
static_assert(kAttendHeads * kAttendTileKeys <= kTileFloats, "an attend tile's scores fit the output tile");
static_assert(kConsumerThreads == kAttendHeads * 16 && kComputeWarps == kAttendTileKeys,
              "16 threads a head's output, one warp a key of the tile");
constexpr int kSsFloats = kComputeWarps * kMaxWidth;            // per-warp sums of squares
constexpr size_t kSmemLimit = 227 * 1024;  // sm_90's opt-in maximum a CTA
constexpr uint64_t kWaitLimitNs = 10'000'000'000ull;
// A kAttend job's shared memory in x's place: q of 16 heads (rows padded by 8
// values) and a key tile; the k whose x region (8 rows of k + 8) holds it.
constexpr int kAttendQPitch = kAttendMaxRow + 2;  // an odd number of 4-byte words a row: no bank conflicts
constexpr int64_t kAttendXElems = int64_t{kAttendHeads} * kAttendQPitch + int64_t{kAttendTileKeys} * kAttendMaxRow;
constexpr int64_t kAttendXK = ((kAttendXElems + kMaxWidth - 1) / kMaxWidth - 8 + 15) / 16 * 16;
static_assert(kMaxWidth * (kAttendXK + 8) >= kAttendXElems, "x's region holds an attend job's q and key tile");

int64_t widest_k(const Program& p) {
  int64_t k = 16;
  for (int s = 0; s < p.num_stages; ++s)
    if (!x_from_global(p.stages[s])) k = p.stages[s].k > k ? p.stages[s].k : k;
  // A kAttend job keeps q and a key tile in x's place: kAttendXElems values (8 rows of k + 8).
  for (int s = 0; s < p.num_stages; ++s)
    if (p.stages[s].kind == Kind::kAttend) k = k < kAttendXK ? kAttendXK : k;
  return k;
}

// Shared-memory carve-up, the same on host and device.
struct Layout {
  int slots = 0;
  int64_t x_pitch = 0;  // elements of one row of x
  size_t ring = 0, full = 0, empty = 0, red = 0, tile = 0, ss = 0, x = 0, total = 0;
};
__host__ __device__ inline Layout layout(int slots, int64_t k_max) {
  Layout l;
  l.slots = slots;
  l.x_pitch = k_max + 8;
  l.ring = 0;
  l.full = l.ring + static_cast<size_t>(slots) * kSlotBytes;
  l.empty = l.full + kMaxSlots * 8;
  l.red = l.empty + kMaxSlots * 8;
  l.tile = l.red + kRedFloats * 4;
  l.ss = l.tile + kTileFloats * 4;
  l.x = l.ss + kSsFloats * 4;
  l.total = l.x + static_cast<size_t>(kMaxWidth) * l.x_pitch * 2;
  return l;
}

__device__ __forceinline__ void compute_barrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kComputeWarps * 32) : "memory");
}
__device__ __forceinline__ int32_t load_acquire(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ float bf16_round(float f) { return __bfloat162float(__float2bfloat16(f)); }

// The compute threads wait until every job of the stages in `mask` has
// finished; every compute thread must call it. Compute thread s polls stage
// s's counter, so the waits on several stages overlap their round trips to
// L2 instead of following one another.
// (release_acquire: Program::release_counters, the acquire poll alone, no fence after it.)
__device__ void wait_stages(const Program& p, uint32_t mask, int ct, bool release_acquire = false) {
  if (ct < kMaxStages && ct < p.num_stages && (mask >> ct & 1u)) {
    const int s = ct;
    const int32_t target = stage_jobs(p.stages[s]);
    const uint64_t t0 = global_ns();
    while (load_acquire(p.counters + s) < target)
      if (global_ns() - t0 > kWaitLimitNs) {  // a program that cannot finish: fail, never hang
        printf("decode program: CTA %d has waited 10 s for stage %d (%d of %d jobs done); trapping\n",
               static_cast<int>(blockIdx.x), s, load_acquire(p.counters + s), target);
        __trap();
      }
    if (!release_acquire) __threadfence();
  }
  compute_barrier();
}

// x of stage s for rows < p.rows into xs (row pitch `pitch` elements).
__device__ void build_x(const Program& p, const Stage& s, int32_t tile, const uint16_t* x, uint16_t* xs, int64_t pitch,
                        float* ss_smem, int ct) {
  const int64_t kv = s.k / 8;  // 16-byte vectors a row
  const int rows = p.rows;
  if (s.prologue == Prologue::kLoad) {
    for (int64_t idx = ct; idx < rows * kv; idx += kConsumerThreads) {
      const int64_t r = idx / kv, v = idx % kv;
      const uint4 val = __ldcg(reinterpret_cast<const uint4*>(x + r * s.x_stride + v * 8));
      *reinterpret_cast<uint4*>(xs + r * pitch + v * 8) = val;
    }
    compute_barrier();
    return;
  }
  // residual + delta (kRmsNorm: the x row), twice: once for the sums of
  // squares (and residual_out), once to normalise (the rows are in L2;
  // registers could not hold them).
  auto load_v = [&](int64_t r, int64_t v, float (&f)[8]) {
    if (s.prologue == Prologue::kRmsNorm) {
      cuda_common::bf16x8_to_f32(__ldcg(reinterpret_cast<const uint4*>(x + r * s.x_stride + v * 8)), f);
      return;
    }
    const float4* res = reinterpret_cast<const float4*>(s.residual + r * s.k + v * 8);
    const float4 a = __ldcg(res), b = __ldcg(res + 1);
    float d[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (s.delta) cuda_common::bf16x8_to_f32(__ldcg(reinterpret_cast<const uint4*>(s.delta + r * s.k + v * 8)), d);
    f[0] = a.x + d[0];
    f[1] = a.y + d[1];
    f[2] = a.z + d[2];
    f[3] = a.w + d[3];
    f[4] = b.x + d[4];
    f[5] = b.y + d[5];
    f[6] = b.z + d[6];
    f[7] = b.w + d[7];
  };
  const int warp = ct / 32, lane = ct % 32;
  float ss[kMaxWidth];
#pragma unroll
  for (int r = 0; r < kMaxWidth; ++r) {
    ss[r] = 0.0f;
    if (r >= rows) continue;
    for (int64_t v = ct; v < kv; v += kConsumerThreads) {
      float f[8];
      load_v(r, v, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss[r] += f[j] * f[j];
      if (tile == 0 && s.residual_out && s.prologue == Prologue::kAddRmsNorm) {
        float4* out = reinterpret_cast<float4*>(s.residual_out + r * s.k + v * 8);
        out[0] = make_float4(f[0], f[1], f[2], f[3]);
        out[1] = make_float4(f[4], f[5], f[6], f[7]);
      }
    }
    ss[r] = cuda_common::warp_sum(ss[r]);
  }
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < kMaxWidth; ++r) ss_smem[warp * kMaxWidth + r] = ss[r];
  compute_barrier();
#pragma unroll
  for (int r = 0; r < kMaxWidth; ++r) {
    if (r >= rows) continue;
    float total = 0.0f;
    for (int w = 0; w < kComputeWarps; ++w) total += ss_smem[w * kMaxWidth + r];
    const float inv = rsqrtf(total / static_cast<float>(s.k) + s.eps);
    for (int64_t v = ct; v < kv; v += kConsumerThreads) {
      float f[8];
      load_v(r, v, f);
      const float4* nw = reinterpret_cast<const float4*>(s.norm_w + v * 8);
      const float4 w0 = __ldg(nw), w1 = __ldg(nw + 1);
      uint4 packed;
      packed.x = cuda_common::pack_bf16x2(f[0] * inv * w0.x, f[1] * inv * w0.y);
      packed.y = cuda_common::pack_bf16x2(f[2] * inv * w0.z, f[3] * inv * w0.w);
      packed.z = cuda_common::pack_bf16x2(f[4] * inv * w1.x, f[5] * inv * w1.y);
      packed.w = cuda_common::pack_bf16x2(f[6] * inv * w1.z, f[7] * inv * w1.w);
      *reinterpret_cast<uint4*>(xs + r * pitch + v * 8) = packed;
    }
  }
  compute_barrier();  // x complete; ss_smem free again
}

// Routes row `row` (one warp; lane holds experts lane, lane + 32, ... below
// num_experts) by kernels/moe/moe_ref.h's rules: writes its top_k expert ids
// and weights.
__device__ void route_row(const Stage& s, int row, int lane, int32_t* ids, float* weights) {
  constexpr int kPer = kMaxExperts / 32;
  const int E = s.num_experts;
  const float* l = s.logits + static_cast<int64_t>(row) * E;
  float score[kPer], choice[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    score[i] = e < E ? __ldcg(l + e) : -INFINITY;
    mx = fmaxf(mx, score[i]);
  }
  if (s.scoring == Scoring::kSoftmax) {
    mx = cuda_common::warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      score[i] = lane + 32 * i < E ? expf(score[i] - mx) : 0.0f;
      sum += score[i];
    }
    sum = cuda_common::warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kPer; ++i) score[i] /= sum;
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) score[i] = 1.0f / (1.0f + expf(-score[i]));
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    choice[i] = e < E ? (s.bias ? score[i] + __ldg(s.bias + e) : score[i]) : -INFINITY;
  }
  if (s.method == TopK::kNoauxTc && s.n_group > 1) {
    // Group g holds experts [g * gs, (g + 1) * gs); its score is the sum of
    // its two largest choices (one when gs = 1); the topk_group best groups
    // (ties: the lower group) stay, the others' experts are never chosen.
    const int gs = E / s.n_group;
    float group[kMaxGroups];
#pragma unroll
    for (int g = 0; g < kMaxGroups; ++g) {
      group[g] = -INFINITY;
      if (g >= s.n_group) continue;
      float v1 = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if ((lane + 32 * i) / gs == g && lane + 32 * i < E) v1 = fmaxf(v1, choice[i]);
      const float m1 = cuda_common::warp_max(v1);
      // One occurrence of m1 (the lowest expert holding it) left out for the second.
      int first = 1 << 30;
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if ((lane + 32 * i) / gs == g && lane + 32 * i < E && choice[i] == m1 && lane + 32 * i < first)
          first = lane + 32 * i;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
      float v2 = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if ((lane + 32 * i) / gs == g && lane + 32 * i < E && lane + 32 * i != first) v2 = fmaxf(v2, choice[i]);
      group[g] = gs > 1 ? m1 + cuda_common::warp_max(v2) : m1;
    }
    uint32_t kept = 0;
    for (int k = 0; k < s.topk_group; ++k) {
      int best = -1;
      float best_score = 0.0f;
#pragma unroll
      for (int g = 0; g < kMaxGroups; ++g)
        if (g < s.n_group && !(kept >> g & 1u) && (best < 0 || group[g] > best_score)) {
          best = g;
          best_score = group[g];
        }
      kept |= 1u << best;
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i < E && !(kept >> ((lane + 32 * i) / gs) & 1u)) choice[i] = -INFINITY;
  }
  uint32_t taken = 0;
  float sum = 0.0f;
  for (int c = 0; c < s.top_k; ++c) {
    // This lane's best untaken expert, then the warp's (ties: the lower index).
    bool valid = false;
    float v = 0.0f;
    int e = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i < E && !(taken >> i & 1u) && (!valid || choice[i] > v)) {
        valid = true;
        v = choice[i];
        e = lane + 32 * i;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const bool ovalid = __shfl_xor_sync(0xffffffffu, valid, o);
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oe = __shfl_xor_sync(0xffffffffu, e, o);
      if (ovalid && (!valid || ov > v || (ov == v && oe < e))) {
        valid = true;
        v = ov;
        e = oe;
      }
    }
    float w = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (e == lane + 32 * i) {
        taken |= 1u << i;
        w = score[i];
      }
    w = __shfl_sync(0xffffffffu, w, e % 32);
    if (lane == 0) {
      ids[c] = e;
      weights[c] = w;
    }
    sum += w;
  }
  __syncwarp();
  if (lane == 0) {
    for (int c = 0; c < s.top_k; ++c) {
      float w = weights[c];
      if (s.method == TopK::kNoauxTc) {
        if (s.norm_topk_prob) w /= (sum + 1e-20f);
        w *= s.routed_scaling_factor;
      } else if (s.top_k > 1 && s.norm_topk_prob) {
        w /= (sum + 1e-20f);
      } else {
        w *= s.routed_scaling_factor;
      }
      weights[c] = w;
    }
  }
}

// A kSelect job: each row's route (one warp a row), then the table.
__device__ void select_job(const Program& p, const Stage& s, float* scratch, int ct) {
  const int cw = ct / 32, lane = ct % 32;
  int32_t* ids = reinterpret_cast<int32_t*>(scratch);  // [rows * top_k]
  float* weights = scratch + kMaxRouteSlots;            // [rows * top_k]
  int32_t* list = ids + 2 * kMaxRouteSlots;             // the distinct experts, increasing
  int32_t* count = list + kMaxRouteSlots;
  if (cw < p.rows) route_row(s, cw, lane, ids + cw * s.top_k, weights + cw * s.top_k);
  compute_barrier();
  const int n = p.rows * s.top_k;
  if (ct == 0) {  // at most 64 ids: an insertion sort, duplicates dropped
    int c = 0;
    for (int i = 0; i < n; ++i) {
      const int32_t e = ids[i];
      int j = c;
      bool dup = false;
      for (int m = 0; m < c; ++m) dup |= list[m] == e;
      if (dup) continue;
      while (j > 0 && list[j - 1] > e) {
        list[j] = list[j - 1];
        --j;
      }
      list[j] = e;
      ++c;
    }
    *count = c;
  }
  compute_barrier();
  const int c = *count;
  RouteTable* t = s.table;
  for (int idx = ct; idx < p.rows * c; idx += kConsumerThreads) {
    const int r = idx / c, u = idx % c;
    float w = 0.0f;
    for (int j = 0; j < s.top_k; ++j)
      if (ids[r * s.top_k + j] == list[u]) w = weights[r * s.top_k + j];
    t->weight[r][u] = w;
  }
  for (int u = ct; u < c; u += kConsumerThreads) t->expert[u] = list[u];
  if (ct == 0) t->count = c;
}

// A kRopeCache job: row r (nothing for a pad row), as rope_kv_cache_kernel
// (kernels/rope/rope_kv_cache.cu) computes a bf16 row with the kv norm fused:
// thread t's partial sum of squares over columns t, t + 256, ..., the eight
// warps' sums added as block_sum adds them, sincosf of f32(pos) * inv_freq[i].
__device__ void rope_job(const Program& p, const Stage& s, int32_t r, float* scratch, int ct) {
  if (r >= p.rows) return;  // uniform over the compute threads
  const int cw = ct / 32, lane = ct % 32;
  const uint16_t* kv = s.x + r * s.x_stride;
  const int64_t slot = __ldcg(s.slot_mapping + r);
  const float pos = static_cast<float>(__ldcg(s.positions + r));
  const int half = s.qk_rope / 2, head = s.qk_nope + s.qk_rope, width = s.kv_lora + s.qk_rope;
  auto bf = [](const uint16_t* v) { return __uint_as_float(static_cast<uint32_t>(*v) << 16); };
  // The latent's RMSNorm (every thread takes part in the sum, whatever the slot).
  float ss = 0.0f;
  for (int i = ct; i < s.kv_lora; i += kConsumerThreads) {
    const float v = bf(kv + i);
    ss += v * v;
  }
  ss = cuda_common::warp_sum(ss);
  if (lane == 0) scratch[cw] = ss;
  compute_barrier();
  // The eight warps' sums added as cuda_common::block_sum adds them (the plain
  // kernel's order: a cache row is the same bits whichever kernel wrote it).
  const float total = cuda_common::warp_sum(lane < kComputeWarps ? scratch[lane] : 0.0f);
  const float inv = rsqrtf(total / static_cast<float>(s.kv_lora) + s.eps);
  __nv_bfloat16* row = slot >= 0 ? reinterpret_cast<__nv_bfloat16*>(s.cache) + slot * width : nullptr;
  if (row)
    for (int i = ct; i < s.kv_lora; i += kConsumerThreads) row[i] = __float2bfloat16(bf(kv + i) * inv * s.norm_w[i]);
  // q_pe of every head, then k_pe.
  for (int idx = ct; idx < (s.num_heads + 1) * half; idx += kConsumerThreads) {
    const int h = idx / half, i = idx % half;
    float sn, c;
    sincosf(pos * __ldg(s.inv_freq + i), &sn, &c);
    c *= s.attention_factor;
    sn *= s.attention_factor;
    if (h < s.num_heads) {
      __nv_bfloat16* x = reinterpret_cast<__nv_bfloat16*>(s.q) + r * s.q_stride + h * head + s.qk_nope + 2 * i;
      const float a = __bfloat162float(x[0]), b = __bfloat162float(x[1]);
      x[0] = __float2bfloat16(a * c - b * sn);
      x[1] = __float2bfloat16(b * c + a * sn);
      if (s.q_pe_out) {
        __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(s.q_pe_out) + r * s.q_pe_out_stride +
                           h * s.q_pe_out_head_stride + 2 * i;
        o[0] = x[0];
        o[1] = x[1];
      }
    } else if (row) {
      const float a = bf(kv + s.kv_lora + 2 * i), b = bf(kv + s.kv_lora + 2 * i + 1);
      row[s.kv_lora + 2 * i] = __float2bfloat16(a * c - b * sn);
      row[s.kv_lora + 2 * i + 1] = __float2bfloat16(b * c + a * sn);
    }
  }
  if (s.residual_copy_to)
    for (int64_t i = ct; i < s.n_residual; i += kConsumerThreads)
      s.residual_copy_to[r * s.n_residual + i] = __ldcg(s.residual_out + r * s.n_residual + i);
}

// A kMerge job (mono_program.h): row j / num_heads, head j % num_heads. The
// split weights come from warp 0 through mla_decode_detail::split_weights
// and each column sums its splits in split order: the attention's own merge
// (launch_mla_decode_output_small), the same bits.
__device__ void merge_job(const Program& p, const Stage& s, int32_t j, float* scratch, int ct) {
  const int r = j / s.num_heads, h = j % s.num_heads;
  if (r >= p.rows) return;  // uniform over the compute threads
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(s.out) + r * s.out_stride + static_cast<int64_t>(h) * s.kv_lora;
  if (s.splits == 1) {
    const uint16_t* x = s.x + r * s.x_stride + static_cast<int64_t>(h) * s.kv_lora;
    for (int c = ct; c < s.kv_lora; c += kConsumerThreads) out[c] = __ushort_as_bfloat16(__ldcg(x + c));
    return;
  }
  const int64_t H = s.num_heads;
  if (ct < 32) {
    const int seq = __ldcg(s.token_seq + r);
    const int keys = __ldcg(s.context_lens + seq) + (r - __ldcg(s.query_start + seq)) + 1;
    const int ns = kernels::mla_split_count(keys, s.splits, s.min_split_keys, p.rows, s.key_tile);
    mla_decode_detail::split_weights(s.lse + static_cast<int64_t>(r) * s.splits * H + h, H, ns, scratch, ct);
    if (ct == 0) scratch[kMlaDecodeMaxSplits] = __int_as_float(ns);
  }
  compute_barrier();
  const int ns = __float_as_int(scratch[kMlaDecodeMaxSplits]);
  const float* src = s.partials + (static_cast<int64_t>(r) * s.splits * H + h) * s.kv_lora;
  const int64_t split_stride = H * s.kv_lora;
  for (int c = ct; c < s.kv_lora; c += kConsumerThreads) {
    float acc = 0.0f;
    for (int t = 0; t < ns; ++t) acc += scratch[t] * __ldcg(src + t * split_stride + c);
    out[c] = __float2bfloat16_rn(acc);
  }
}

// A kAttend job (mono_program.h): row r, head group g, split `split`, on CUDA
// cores. Shared memory (the x region): q_full of the group's heads [16][row
// + 2] bf16 (padded against bank conflicts), then a tile of kAttendTileKeys
// latent rows [8][row] bf16. Per tile: warp w scores key w for every head
// (lane l: head l % 16, half l / 16 of the row), then compute thread t keeps
// o[head t / 16][column pairs 2 (t % 16) + 32 i] with the head's running max
// and sum (the same values in the 16 threads of a head).
__device__ void attend_job(const Program& p, const Stage& s, int32_t j, uint16_t* xs, float* scratch, int ct) {
  const int groups = attend_groups(s);
  const int split = j % s.splits, g = (j / s.splits) % groups, r = j / (s.splits * groups);
  if (r >= p.rows) return;  // uniform over the compute threads
  const int seq = __ldcg(s.token_seq + r);
  const int keys = __ldcg(s.context_lens + seq) + (r - __ldcg(s.query_start + seq)) + 1;
  const int chunk = kernels::mla_split_chunk(keys, s.splits, s.min_split_keys, p.rows, s.key_tile);
  const int k0 = split * chunk, k1 = min(keys, k0 + chunk);
  if (k0 >= k1) return;
  const int row_w = s.kv_lora + s.qk_rope, vecs = row_w / 8;
  const int h0 = g * kAttendHeads, nh = min(kAttendHeads, s.num_heads - h0);
  const int cw = ct / 32, lane = ct % 32;
  uint16_t* qs = xs;
  uint16_t* ks = xs + kAttendHeads * kAttendQPitch;
  for (int idx = ct; idx < nh * vecs; idx += kConsumerThreads) {  // (q rows are 4-byte aligned: 4-byte stores)
    const int h = idx / vecs, v = idx % vecs;
    const uint4 val =
        __ldcg(reinterpret_cast<const uint4*>(s.x + r * s.x_stride + static_cast<int64_t>(h0 + h) * row_w + v * 8));
    uint32_t* dst = reinterpret_cast<uint32_t*>(qs + h * kAttendQPitch + v * 8);
    dst[0] = val.x;
    dst[1] = val.y;
    dst[2] = val.z;
    dst[3] = val.w;
  }
  const int32_t* table = s.block_tables + static_cast<int64_t>(seq) * s.max_blocks;
  // Thread t: head t / 16, the column pairs 2 (t % 16) + 32 i (i < kv_lora / 32): a head's 16 threads read 16
  // consecutive words of a key row at a time (no bank conflicts).
  const int oh = ct / 16, pairs = s.kv_lora / 32, oc = 2 * (ct % 16);
  float o[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  constexpr float kLog2e = 1.4426950408889634f;
  for (int kt = k0; kt < k1; kt += kAttendTileKeys) {
    const int nk = min(kAttendTileKeys, k1 - kt);
    compute_barrier();  // q is in place; the tile before is consumed
    for (int idx = ct; idx < nk * vecs; idx += kConsumerThreads) {
      const int kk = idx / vecs, v = idx % vecs, key = kt + kk;
      const int64_t slot = static_cast<int64_t>(__ldcg(table + key / s.block_size)) * s.block_size + key % s.block_size;
      *reinterpret_cast<uint4*>(ks + kk * row_w + v * 8) =
          __ldcg(reinterpret_cast<const uint4*>(s.cache + slot * row_w + v * 8));
    }
    compute_barrier();
    if (cw < nk) {  // warp cw scores key cw
      const int h = lane % kAttendHeads, half = lane / kAttendHeads;
      float acc = 0.0f;
      if (h < nh) {
        const int d0 = half * (row_w / 2), d1 = d0 + row_w / 2;  // row_w / 2 is even: bf16 pairs
        const __nv_bfloat162* q2 = reinterpret_cast<const __nv_bfloat162*>(qs + h * kAttendQPitch);
        const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(ks + cw * row_w);
        for (int d = d0 / 2; d < d1 / 2; ++d) {
          const float2 a = __bfloat1622float2(q2[d]), b = __bfloat1622float2(k2[d]);
          acc = fmaf(a.x, b.x, acc);
          acc = fmaf(a.y, b.y, acc);
        }
      }
      acc += __shfl_xor_sync(0xffffffffu, acc, kAttendHeads);
      if (half == 0 && h < nh) scratch[h * kAttendTileKeys + cw] = acc * s.scale * kLog2e;
    }
    compute_barrier();
    if (oh < nh) {
      float mt = m;
      for (int kk = 0; kk < nk; ++kk) mt = fmaxf(mt, scratch[oh * kAttendTileKeys + kk]);
      const float corr = exp2f(m - mt);  // 0 on the first tile (m = -inf, o and l 0)
      l *= corr;
#pragma unroll
      for (int i = 0; i < 32; ++i) o[i] *= corr;
      for (int kk = 0; kk < nk; ++kk) {
        const float pk = exp2f(scratch[oh * kAttendTileKeys + kk] - mt);
        l += pk;
        const __nv_bfloat162* vr = reinterpret_cast<const __nv_bfloat162*>(ks + kk * row_w + oc);
#pragma unroll
        for (int i = 0; i < 16; ++i)
          if (i < pairs) {
            const float2 vv = __bfloat1622float2(vr[16 * i]);
            o[2 * i] = fmaf(pk, vv.x, o[2 * i]);
            o[2 * i + 1] = fmaf(pk, vv.y, o[2 * i + 1]);
          }
      }
      m = mt;
    }
  }
  if (oh < nh) {
    const int64_t base = (static_cast<int64_t>(r) * s.splits + split) * s.num_heads + h0 + oh;
    const float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (i < pairs)
        *reinterpret_cast<float2*>(s.part_o + base * s.kv_lora + oc + 32 * i) = make_float2(o[2 * i] * inv, o[2 * i + 1] * inv);
    if (ct % 16 == 0) s.part_lse[base] = m + log2f(l);
  }
}

// A kCombine job: columns [first, first + cols) of every row.
__device__ void combine_job(const Program& p, const Stage& s, int32_t job, float* scratch, int ct) {
  const RouteTable* t = s.route;
  const int c = t ? __ldcg(&t->count) : 0;  // no table (a dense MLP): the shared outputs only
  float* w = scratch;  // [rows][count]
  for (int idx = ct; idx < p.rows * c; idx += kConsumerThreads) w[idx] = __ldcg(&t->weight[idx / c][idx % c]);
  compute_barrier();
  const int32_t cols = job_columns(s, job);
  const int64_t first = job_first_column(s, job);
  for (int idx = ct; idx < p.rows * cols; idx += kConsumerThreads) {
    const int r = idx / cols;
    const int64_t i = first + idx % cols;
    float acc = 0.0f;
    for (int u = 0; u < c; ++u) acc += w[r * c + u] * __ldcg(s.partials + u * s.x_slot_stride + r * s.n + i);
    if (s.shared)
      for (int u = 0; u < s.shared_slots; ++u) acc += __ldcg(s.shared + u * s.shared_slot_stride + r * s.n + i);
    reinterpret_cast<__nv_bfloat16*>(s.out)[r * s.out_stride + i] = __float2bfloat16(acc);
    if (s.residual_copy_to) s.residual_copy_to[r * s.n + i] = __ldcg(s.residual_out + r * s.n + i);
  }
}

// probe: bit 0 copy_only, bit 1 cp_async, 3 rotate, 4 packed_rows, 5 contiguous, 6 no_hint
// (MonoProbe); 0 and a null timeline in the engine. The builds (Program::lean): kFp8 with FP8 weights,
// kKinds with the stages other than unslotted GEMVs (routed and slotted GEMVs, select, RoPE, attend, merge,
// combine); the full build has both.
template <bool kFp8, bool kKinds>
__global__ void __launch_bounds__(kThreads, 1) mono_program_kernel(const __grid_constant__ Program p, int slots,
                                                                   int64_t k_max, int probe,
                                                                   unsigned long long* timeline) {
  extern __shared__ __align__(128) uint8_t smem[];
  const Layout L = layout(slots, k_max);
  const uint32_t ring = ptx::smem_u32(smem + L.ring);
  const uint32_t full = ptx::smem_u32(smem + L.full), empty = ptx::smem_u32(smem + L.empty);
  const bool copy_only = probe & 1, lane_copies = probe & 2, release_acquire = p.release_counters;
  const bool rotate = probe & 8, packed_rows = probe & 16, contiguous = probe & 32, no_hint = probe & 64;
  unsigned long long* tl = timeline ? timeline + kTimelineFields * blockIdx.x : nullptr;
  if (tl && threadIdx.x == 0) tl[0] = global_ns();
  if (threadIdx.x == 0) {
    for (int i = 0; i < slots; ++i) {
      ptx::mbarrier_init(full + 8 * i, lane_copies ? 32 : 1);
      ptx::mbarrier_init(empty + 8 * i, kComputeWarps);
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  pdl::launch_dependents();
  const int32_t q0 = p.queue_start[blockIdx.x], q1 = p.queue_start[blockIdx.x + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (warp == 0) {  // the copy warp
    const uint64_t policy = ptx::l2_evict_first_policy();
    uint32_t chunk = 0;
    bool waited = false;
    for (int32_t q = q0; q < q1; ++q) {
      const Job job = p.jobs[q];
      const Stage& s = p.stages[job.stage];
      int32_t groups = job_groups(s, job.tile);
      const uint8_t* w = static_cast<const uint8_t*>(s.w);
      if (kKinds && groups > 0 && slotted(s)) {
        int32_t expert = job_slot(s, job.tile);  // no table: slot u is expert u
        if (routed(s)) {
          // The one wait for the step's results: which expert this slot streams.
          if (!waited) pdl::wait_for_inputs();  // counters and the table are this launch's from here on
          waited = true;
          if (lane == 0) {
            const uint64_t t0 = global_ns();
            while (load_acquire(p.counters + s.route_stage) < 1)
              if (global_ns() - t0 > kWaitLimitNs) {
                printf("decode program: CTA %d's copy warp has waited 10 s for route stage %d; trapping\n",
                       static_cast<int>(blockIdx.x), s.route_stage);
                __trap();
              }
            expert = expert < __ldcg(&s.route->count) ? __ldcg(&s.route->expert[expert]) : -1;
          }
          expert = __shfl_sync(0xffffffffu, expert, 0);
        }
        if (expert < 0) groups = 0;  // an unused slot: the compute warps skip it too
        else w = static_cast<const uint8_t*>(expert_weight(s, expert));
      }
      const int64_t eb = weight_element_bytes(s);
      const int32_t slices = stage_slices(s);
      const int32_t rot = rotate && slices > 0 ? static_cast<int32_t>(blockIdx.x) % slices : 0;
      for (int32_t g = 0; g < groups; ++g) {
        const GroupRows gr = job_group(s, job.tile, g);
        for (int32_t si = 0; si < slices; ++si, ++chunk) {
          const int32_t sl = (si + rot) % slices;
          const uint32_t slot = chunk % slots, round = chunk / slots;
          const int32_t kc = slice_columns(s, sl);
          if (lane_copies) {  // (MonoProbe::cp_async) 16-byte copies by all 32 lanes, then one arrival each
            if (lane == 0 && round > 0) ptx::mbarrier_wait_parity(empty + 8 * slot, (round - 1) & 1u);
            __syncwarp();
            const int pieces = static_cast<int>(kc * eb / 16);  // 16-byte pieces a row
            for (int i = lane; i < gr.count * pieces; i += 32) {
              const int row = i / pieces, piece = i % pieces;
              ptx::cp_async_16(ring + slot * kSlotBytes + row * kRowPitch + piece * 16,
                               w + ((gr.first_row + row) * s.k + slice_first(s, sl)) * eb + piece * 16, 16);
            }
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full + 8 * slot) : "memory");
            continue;
          }
          if (lane == 0) {
            if (round > 0) ptx::mbarrier_wait_parity(empty + 8 * slot, (round - 1) & 1u);
            ptx::mbarrier_arrive_expect_tx(full + 8 * slot, static_cast<uint32_t>(gr.count * kc * eb));
          }
          __syncwarp();
          if (contiguous) {  // (MonoProbe::contiguous, copy_only) the chunk's bytes as one run
            if (lane == 0)
              ptx::bulk_copy_g2s(ring + slot * kSlotBytes, w + (gr.first_row * s.k + slice_first(s, sl) * gr.count) * eb,
                                 static_cast<uint32_t>(gr.count * kc * eb), full + 8 * slot, policy);
          } else if (lane < gr.count) {
            const uint32_t dst = ring + slot * kSlotBytes + lane * (packed_rows ? kSliceK * 2 : kRowPitch);
            const uint8_t* src = w + ((gr.first_row + lane) * s.k + slice_first(s, sl)) * eb;
            if (no_hint)  // (MonoProbe::no_hint)
              asm volatile(
                  "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                  "l"(src), "r"(static_cast<uint32_t>(kc * eb)), "r"(full + 8 * slot)
                  : "memory");
            else
              ptx::bulk_copy_g2s(dst, src, static_cast<uint32_t>(kc * eb), full + 8 * slot, policy);
          }
        }
      }
    }
    if (tl && lane == 0) tl[5] = global_ns();
    // (MonoProbe::cp_async: no lane leaves with its copies in flight.)
    if (lane_copies) asm volatile("cp.async.wait_all;\n" ::: "memory");
    // The compute warps count this CTA out only after this warp's last read
    // of a counter (a route table's), so the reset cannot come before it.
    asm volatile("bar.arrive 2, %0;\n" ::"n"(kThreads) : "memory");
    return;
  }

  // The compute warps.
  const int ct = threadIdx.x - 32, cw = ct / 32;
  float* red = reinterpret_cast<float*>(smem + L.red);
  float* out_tile = reinterpret_cast<float*>(smem + L.tile);
  float* ss_smem = reinterpret_cast<float*>(smem + L.ss);
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem + L.x);
  const uint32_t xs_u32 = ptx::smem_u32(xs);
  pdl::wait_for_inputs();  // the kernel before has finished: activations and counters are final
  if (tl && ct == 0) tl[1] = global_ns();
  // ldmatrix addresses: A (16 weight rows x 16 k) as four 8x8 matrices, B (8
  // rows of x x 16 k) as two.
  const int a_row = ((lane / 8) & 1) * 8 + lane % 8, a_col = (lane / 16) * 8;
  const int b_row = lane % 8, b_col = ((lane / 8) & 1) * 8;
  uint32_t chunk = 0, group_count = 0;
  int32_t x_stage = -1, x_slot = 0;  // whose x xs holds
  int32_t uncounted = 0;             // (thread 0, release counters) finished jobs of the stage not yet added
  for (int32_t q = q0; q < q1; ++q) {
    const Job job = p.jobs[q];
    const Stage& s = p.stages[job.stage];
    if (kKinds && s.kind != Kind::kGemv) {
      wait_stages(p, s.wait_mask, ct, release_acquire);
      if (tl && ct == 0 && q - q0 < kTimelineJobs) tl[6 + 4 * (q - q0)] = global_ns();
      if (s.kind == Kind::kSelect) select_job(p, s, out_tile, ct);
      else if (s.kind == Kind::kRopeCache) rope_job(p, s, job.tile, out_tile, ct);
      else if (s.kind == Kind::kMerge) merge_job(p, s, job.tile, out_tile, ct);
      else if (s.kind == Kind::kAttend) {
        attend_job(p, s, job.tile, xs, out_tile, ct);
        x_stage = -1;  // x's shared memory now holds q and keys
      }
      else combine_job(p, s, job.tile, out_tile, ct);
    } else {
      const int32_t slot = job_slot(s, job.tile);
      wait_stages(p, s.wait_mask, ct, release_acquire);
      if (tl && ct == 0 && q - q0 < kTimelineJobs) tl[6 + 4 * (q - q0)] = global_ns();
      const bool used = !kKinds || !routed(s) || slot < __ldcg(&s.route->count);
      // x carries over within a stage (and slot, for kLoad) and from the
      // earlier stages the planner found to build the same x from inputs
      // nothing rewrote since (Stage::x_reuse); an add + RMSNorm job 0 that
      // writes residual_out always builds it.
      const bool writes = s.prologue == Prologue::kAddRmsNorm && s.residual_out && job.tile == 0;
      const bool carry =
          x_stage >= 0 && !writes &&
          (x_stage == job.stage ? s.prologue == Prologue::kAddRmsNorm || slot == x_slot : (s.x_reuse >> x_stage & 1u));
      // x past kMaxK stays in global memory: the MMAs read row min(lane / 4,
      // rows - 1) there (a pad row's column of the product is never stored;
      // the buffer may hold only `rows` rows).
      const bool xg = x_from_global(s);
      const uint16_t* x_row = xg ? s.x + slot * s.x_slot_stride + min(lane / 4, p.rows - 1) * s.x_stride : nullptr;
      if (used && !carry && !xg) {
        build_x(p, s, job.tile, s.x ? s.x + slot * s.x_slot_stride : nullptr, xs, L.x_pitch, ss_smem, ct);
        if (tl && ct == 0 && q - q0 < kTimelineJobs) tl[7 + 4 * (q - q0)] = global_ns();
        x_stage = job.stage;
        x_slot = slot;
      }
      const int32_t groups = used ? job_groups(s, job.tile) : 0, slices = stage_slices(s);
      const bool fp8 = kFp8 && fp8_weights(s);
      // kFp8Block: this job's scales (its expert's in a slotted stage), row stride fp8_scale_columns(k).
      const float* scale = nullptr;
      if (fp8 && groups > 0)
        scale = expert_scale(s, routed(s) ? __ldcg(&s.route->expert[slot]) : slotted(s) ? slot : 0);
      const int32_t rot = rotate && slices > 0 ? static_cast<int32_t>(blockIdx.x) % slices : 0;
      for (int32_t g = 0; g < groups; ++g) {
        const GroupRows gr = job_group(s, job.tile, g);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int32_t si = 0; si < slices; ++si, ++chunk) {
          const int32_t sl = (si + rot) % slices;
          const uint32_t rs = chunk % slots, round = chunk / slots;
          const int32_t kc = slice_columns(s, sl);
          ptx::mbarrier_wait_parity(full + 8 * rs, round & 1u);
          if (tl && ct == 0) tl[chunk == 0 ? 2 : 3] = global_ns();
          const uint32_t a_base = ring + rs * kSlotBytes + a_row * kRowPitch + a_col * 2;
          if (copy_only) {
            // (MonoProbe::copy_only: no math)
          } else if (!fp8) {
            const uint32_t b_base =
                xs_u32 + static_cast<uint32_t>((b_row * L.x_pitch + slice_first(s, sl) + b_col) * 2);
            // (global x: lane (g, q) holds x[g][k + 2q, + 1] and x[g][k + 2q + 8, + 9], the ldmatrix layout)
            const uint16_t* xk = xg ? x_row + slice_first(s, sl) + 2 * (lane % 4) : nullptr;
#pragma unroll
            for (int st = 0; st < 4; ++st) {
              const int kk = cw * 64 + st * 16;
              if (kk < kc) {
                uint32_t a[4], b0, b1;
                ptx::ldmatrix_x4(a_base + kk * 2, a[0], a[1], a[2], a[3]);
                if (xg) {  // plain (weak, L1-cached) loads: the stage's wait acquired the writer's stores
                  b0 = *reinterpret_cast<const uint32_t*>(xk + kk);
                  b1 = *reinterpret_cast<const uint32_t*>(xk + kk + 8);
                } else {
                  ptx::ldmatrix_x2(b_base + kk * 2, b0, b1);
                }
                ptx::mma_m16n8k16_bf16(acc, a, b0, b1);
              }
            }
          } else if (cw * kFp8Block < kc) {
            // Warp cw's 128 k of the slice: one scale block. ldmatrix of the
            // e4m3 rows gives lane (g, q) = (lane / 4, lane % 4) bytes 4q ...
            // 4q + 3 of rows g and g + 8 in each 16-byte half of a 32-k step;
            // those four k serve the MMA's k slots {2q, 2q + 1, 2q + 8, 2q +
            // 9}, so x comes as x[g][4q ... 4q + 3] (one 8-byte load): the k
            // order within a step is permuted alike on both operands.
            const int kk = cw * static_cast<int>(kFp8Block);
            const int64_t k0 = slice_first(s, sl) + kk;
            const uint16_t* xrow = xg ? x_row + k0 + 4 * (lane % 4) : xs + (lane / 4) * L.x_pitch + k0 + 4 * (lane % 4);
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int st = 0; st < 4; ++st) {
              if (kk + st * 32 >= kc) break;  // k's last scale block may be partial (k % 32 == 0)
              uint32_t r[4];
              ptx::ldmatrix_x4(a_base + kk + st * 32, r[0], r[1], r[2], r[3]);
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                uint32_t a[4];
                fp8_detail::e4m3x4_to_bf16x4(r[2 * h], a[0], a[2]);
                fp8_detail::e4m3x4_to_bf16x4(r[2 * h + 1], a[1], a[3]);
                const uint2 b = *reinterpret_cast<const uint2*>(xrow + st * 32 + h * 16);  // shared, or global (weak)
                ptx::mma_m16n8k16_bf16(part, a, b.x, b.y);
              }
            }
            const float sc = __ldg(scale + (gr.first_row / kFp8Block) * fp8_scale_columns(s.k) + k0 / kFp8Block);
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] += sc * part[i];
          }
          __syncwarp();
          if (lane == 0) ptx::mbarrier_arrive_expect_tx(empty + 8 * rs, 0);  // the slot may be refilled
        }
        // The eight warps' 16 x 8 sums, added in warp order by threads 0 ... 127.
        float* rb = red + (group_count & 1u) * (kComputeWarps * 128);
        *reinterpret_cast<float4*>(rb + cw * 128 + lane * 4) = make_float4(acc[0], acc[1], acc[2], acc[3]);
        compute_barrier();
        if (ct < 128) {
          float total = 0.0f;
          for (int w = 0; w < kComputeWarps; ++w) total += rb[w * 128 + ct];
          // Fragment element ct % 4 of lane ct / 4: row g (+8 for elements 2, 3), row of x 2 t (+1 for odd elements).
          const int fl = ct / 4, e = ct % 4;
          const int row = fl / 4 + (e >= 2 ? 8 : 0), xrow = 2 * (fl % 4) + (e & 1);
          if (row < gr.count && xrow < p.rows) out_tile[xrow * (2 * kMaxTile) + gr.slot + row] = total;
        }
        ++group_count;
      }
      if (tl && ct == 0 && q - q0 < kTimelineJobs) tl[8 + 4 * (q - q0)] = global_ns();
      compute_barrier();  // the output tile is complete
      if (used) {
        const int32_t cols = job_columns(s, job.tile);
        const int64_t first = job_first_column(s, job.tile) + (slotted(s) ? slot * s.out_slot_stride : 0);
        for (int idx = ct; idx < p.rows * cols; idx += kConsumerThreads) {
          const int r = idx / cols, j = idx % cols;
          const float* t = out_tile + r * (2 * kMaxTile);
          if (s.epilogue == Epilogue::kStoreF32) {
            static_cast<float*>(s.out)[r * s.out_stride + first + j] = t[j];
            continue;
          }
          float v = t[j];
          if (s.epilogue == Epilogue::kSiluMulBf16) {
            const float gate = bf16_round(t[j]), up = bf16_round(t[kMaxTile + j]);
            v = gate / (1.0f + expf(-gate)) * up;
          }
          static_cast<__nv_bfloat16*>(s.out)[r * s.out_stride + first + j] = __float2bfloat16(v);
        }
      }
    }
    compute_barrier();  // every column written (and the shared scratch free for the next job)
    if (ct == 0) {
      if (release_acquire) {
        // One release add a stage, after the CTA's last job of a run of it
        // (deal_jobs keeps a stage's jobs back to back, so one add; no job
        // waits for its own stage, and a waiter needs all of a stage's jobs):
        // the writes before the CTA's barrier first.
        ++uncounted;
        if (q + 1 == q1 || p.jobs[q + 1].stage != job.stage) {
          asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p.counters + job.stage), "r"(uncounted)
                       : "memory");
          uncounted = 0;
        }
      } else {
        __threadfence();
        atomicAdd(p.counters + job.stage, 1);
      }
      if (tl && q - q0 < kTimelineJobs) tl[9 + 4 * (q - q0)] = global_ns();
    }
  }
  if (tl && ct == 0) tl[4] = global_ns();
  // The last CTA out clears the counters for the next launch (every other CTA
  // has finished all its waits before it counts itself out; bar 2 waits for
  // the copy warp's).
  asm volatile("bar.sync 2, %0;\n" ::"n"(kThreads) : "memory");
  if (ct == 0) {
    __threadfence();
    if (atomicAdd(p.counters + p.num_stages, 1) == static_cast<int32_t>(gridDim.x) - 1) {
      __threadfence();  // the reset after every CTA's last increment
      for (int s = 0; s <= p.num_stages; ++s) atomicExch(p.counters + s, 0);
      __threadfence();
    }
  }
}

using Kernel = void (*)(Program, int, int64_t, int, unsigned long long*);

// The build program_build(p) names.
Kernel kernel_for(const Program& p) {
  const ProgramBuild b = program_build(p);
  return b.fp8 ? (b.kinds ? mono_program_kernel<true, true> : mono_program_kernel<true, false>)
               : (b.kinds ? mono_program_kernel<false, true> : mono_program_kernel<false, false>);
}

int slots_for(const Program& p, const MonoProbe& probe = {}) {
  const int64_t k = widest_k(p);
  const size_t left = kSmemLimit - layout(0, k).total;
  int slots = static_cast<int>(left / kSlotBytes);
  if (probe.max_slots > 0 && slots > probe.max_slots) slots = probe.max_slots;
  return slots > kMaxSlots ? kMaxSlots : slots;
}

}  // namespace

int mono_ring_slots(const Program& p) { return slots_for(p); }
int mono_ring_slots(const Program& p, const MonoProbe& probe) { return slots_for(p, probe); }

cudaError_t launch_mono_program(const Program& p, cudaStream_t stream, bool pdl) {
  return launch_mono_program(p, stream, pdl, MonoProbe{});
}

cudaError_t launch_mono_program(const Program& p, cudaStream_t stream, bool pdl, const MonoProbe& probe) {
  if ((p.width != 1 && p.width != 2 && p.width != 4 && p.width != 8) || p.rows < 1 || p.rows > p.width ||
      p.num_stages < 1 || p.num_stages > kMaxStages || !p.queue_start || !p.jobs || !p.counters || p.num_ctas < 1 ||
      p.num_ctas > current_device_sms())
    return cudaErrorInvalidValue;
  if ((probe.packed_rows || probe.contiguous) && !probe.copy_only) return cudaErrorInvalidValue;  // garbage sums
  const int slots = slots_for(p, probe);
  if (slots < kMinSlots && !(probe.max_slots > 0 && slots >= 1)) return cudaErrorInvalidValue;
  const cudaError_t attr = cuda_common::once_per_device([] {
    for (const Kernel k : {mono_program_kernel<false, false>, mono_program_kernel<true, false>,
                           mono_program_kernel<false, true>, mono_program_kernel<true, true>}) {
      const cudaError_t e =
          cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemLimit));
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  });
  if (attr != cudaSuccess) return attr;
  const size_t smem = layout(slots, widest_k(p)).total;
  const cudaError_t e =
      pdl::launch(kernel_for(p), static_cast<int64_t>(p.num_ctas), kThreads, smem, pdl, stream, p, slots,
                  widest_k(p),
                  (probe.copy_only ? 1 : 0) | (probe.cp_async ? 2 : 0) |
                      (probe.rotate ? 8 : 0) | (probe.packed_rows ? 16 : 0) | (probe.contiguous ? 32 : 0) |
                      (probe.no_hint ? 64 : 0),
                  probe.timeline);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace nucleus::kernels::mono
