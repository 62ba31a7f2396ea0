// The fused gather_kv_b_proj kernel (see gather_kv_b_proj.cuh).
//
// A CTA (8 warps) owns 128 keys: it gathers their latent rows once into
// shared memory as bf16 (FP8 cache values exactly; k_scale is applied to the
// f32 results), then walks a run of 128-column tiles of kv_b_proj's output,
// streaming the weight in 64-wide k steps through a 5-stage (bf16) or 9-stage
// (FP8) cp.async pipeline that runs on across tiles.
// Each warp computes 64 x 32 with mma.sync m16n8k16 (bf16 in, f32
// accumulate). FP8 weights are converted exactly to bf16 in registers; a
// per-row scale multiplies the f32 result, a block scale each k block's
// partial sum (DeepGEMM's promotion), so no scale is rounded into bf16.
// Results go from the accumulators straight into k's k_nope part or v
// (bf16 pairs; a warp's stores fill whole 32-byte sectors two by two); the
// CTA holding a head's first column also writes that head's k_pe.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/common/cuda_common.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/mla/gather_kv_b_proj.cuh"

namespace nucleus::kernels {
namespace {

constexpr int kBM = kGkvFusedTileM, kBN = kGkvFusedTileN, kBK = kGkvFusedTileK;
constexpr int kThreads = 256;
constexpr int kBStrideBf16 = kBK + 8;  // elements per bf16 B row (144 B: ldmatrix rows on distinct banks)
constexpr int kBStrideFp8 = kBK + 16;  // bytes per FP8 B row (80 B: fragment loads conflict-free)
constexpr int kSlotBytes = kBM * 8;    // int64 slot per row
// Weight stages: as many as fit beside the resident 128 x 520 latent tile
// (kv_lora 512), so that several k steps of weight are in flight per SM.
constexpr int kStagesBf16 = 5;
constexpr int kStagesFp8 = 9;

enum WeightMode : int { kModeBf16 = 0, kModeFp8PerRow = 1, kModeFp8Block = 2 };

__host__ __device__ constexpr int b_stage_bytes(bool fp8) { return fp8 ? kBN * kBStrideFp8 : kBN * kBStrideBf16 * 2; }
__host__ __device__ constexpr int num_stages(bool fp8) { return fp8 ? kStagesFp8 : kStagesBf16; }
__host__ __device__ inline int a_stride(int kv_lora) { return kv_lora + 8; }  // elements; +16 B per row vs banks
__host__ __device__ inline int64_t a_bytes(int kv_lora) { return int64_t{kBM} * a_stride(kv_lora) * 2; }

struct FusedLaunch {
  GatherKvBProjParams p;
  int n = 0;              // num_heads * (qk_nope + v_head)
  int n_tiles = 0;        // ceil(n / kBN)
  int n_splits = 0;       // CTAs per 128-key tile
  int tiles_per_cta = 0;  // column tiles each of them walks
  float out_scale = 1.0f; // k_scale for an FP8 cache, else 1
};

using cuda_common::pack_bf16x2;

// Two e4m3 bytes (low byte first) -> bf16x2, exactly (e4m3 -> f16 -> f32 -> bf16 loses nothing).
__device__ __forceinline__ uint32_t fp8x2_to_bf16x2(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return pack_bf16x2(f.x, f.y);
}

// The same, on the integer and half pipes (the weight tile's hot path):
// placing each byte's 7 magnitude bits under bf16's exponent/mantissa gives
// value * 2^-120 exactly (e4m3 subnormals land on bf16 subnormals), and one
// bf16x2 multiply by 2^120 restores it exactly.
__device__ __forceinline__ uint32_t fp8x2_to_bf16x2_fast(uint32_t two_bytes) {
  const uint32_t s = __byte_perm(two_bytes, 0u, 0x1404);  // halves: [byte << 8]
  uint32_t bits = ((s >> 4) & 0x07f007f0u) | (s & 0x80008000u);
  __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&bits);
  v = __hmul2(v, __floats2bfloat162_rn(0x1p120f, 0x1p120f));
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float e8m0_to_float(uint32_t e) {
  if (e == 0xffu) return __int_as_float(0x7fc00000);
  return e == 0 ? __int_as_float(0x00400000) : __int_as_float(static_cast<int>(e << 23));  // 2^(e-127)
}

__device__ __forceinline__ float load_scale(const void* s, bool e8m0, int64_t i) {
  return e8m0 ? e8m0_to_float(static_cast<const uint8_t*>(s)[i]) : static_cast<const float*>(s)[i];
}

// 8 cache elements from element offset `e` as 8 bf16 (FP8 unscaled).
__device__ __forceinline__ uint4 load8_as_bf16(const void* cache, DType dt, int64_t e) {
  if (dt == DType::kBF16) return *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(cache) + e);
  if (dt == DType::kF8E4M3) {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(cache) + e);
    return make_uint4(fp8x2_to_bf16x2(raw.x), fp8x2_to_bf16x2(raw.x >> 16), fp8x2_to_bf16x2(raw.y),
                      fp8x2_to_bf16x2(raw.y >> 16));
  }
  const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(cache) + e);
  const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(cache) + e + 4);
  return make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
}

// 8 cache elements as bf16 after multiplying by `s` in f32 (k_pe).
__device__ __forceinline__ uint4 load8_scaled(const void* cache, DType dt, int64_t e, float s) {
  if (dt == DType::kBF16) return load8_as_bf16(cache, dt, e);  // never scaled: copied as is
  float f[8];
  if (dt == DType::kF8E4M3) {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(cache) + e);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = i < 2 ? raw.x : raw.y;
      const __half2_raw h =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>((w >> (16 * (i & 1))) & 0xffffu), __NV_E4M3);
      const float2 v = __half22float2(__half2(h));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  } else {
    const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(cache) + e);
    const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(cache) + e + 4);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  }
  return make_uint4(pack_bf16x2(f[0] * s, f[1] * s), pack_bf16x2(f[2] * s, f[3] * s), pack_bf16x2(f[4] * s, f[5] * s),
                    pack_bf16x2(f[6] * s, f[7] * s));
}

template <int kMode>
__global__ void __launch_bounds__(kThreads, 1) gather_kv_b_proj_fused_kernel(const __grid_constant__ FusedLaunch L) {
  constexpr bool kFp8 = kMode != kModeBf16;
  constexpr int kStages = num_stages(kFp8);
  constexpr int kStageBytes = b_stage_bytes(kFp8);
  const GatherKvBProjParams& p = L.p;
  extern __shared__ __align__(128) unsigned char smem[];
  int64_t* row_slot = reinterpret_cast<int64_t*>(smem);                     // [kBM], -1: past num_keys
  __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem + kSlotBytes);  // [kBM][kv_lora + 8]
  unsigned char* Bs = smem + kSlotBytes + a_bytes(p.kv_lora);               // kStages x [kBN][row]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;  // warp tile: rows wm*64 + [0, 64), columns wn*32 + [0, 32)
  const int m_tile = blockIdx.x / L.n_splits, split = blockIdx.x % L.n_splits;
  const int t_begin = split * L.tiles_per_cta;
  const int t_end = min(t_begin + L.tiles_per_cta, L.n_tiles);
  if (t_begin >= t_end) return;
  const int64_t row0 = int64_t{m_tile} * kBM;
  const int rows = static_cast<int>(p.num_keys - row0 < kBM ? p.num_keys - row0 : kBM);
  const int ksteps = p.kv_lora / kBK;
  const int total = (t_end - t_begin) * ksteps;
  const int as = a_stride(p.kv_lora);
  const int64_t width = p.kv_lora + p.qk_rope;
  const int head_kv = p.qk_nope + p.v_head, k_row = p.qk_nope + p.qk_rope;

  if (tid < kBM) {
    int64_t slot = -1;
    if (tid < rows) {
      const int64_t pos = p.key_begin + row0 + tid;
      slot = int64_t{p.block_table[pos / p.block_size]} * p.block_size + pos % p.block_size;
    }
    row_slot[tid] = slot;
  }
  __syncthreads();

  // The weight rows and 16-byte chunks this thread copies each step (fixed),
  // and the step it copies next (column tile ld_t, k step ld_ks, stage ld_stage).
  constexpr int kChunksPerRow = kFp8 ? kBK / 16 : kBK / 8;
  constexpr int kLoads = kBN * kChunksPerRow / kThreads;
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  const auto* wbytes = static_cast<const unsigned char*>(p.weight);
  int ld_t = t_begin, ld_ks = 0, ld_stage = 0;
  auto load_b = [&]() {
    const int64_t n0 = int64_t{ld_t} * kBN;
    unsigned char* dst = Bs + ld_stage * kStageBytes;
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int c = tid + j * kThreads, r = c / kChunksPerRow, cc = c % kChunksPerRow;
      const int64_t n = n0 + r;
      const bool valid = n < L.n;
      const unsigned char* src = wbytes + ((valid ? n : 0) * p.kv_lora + ld_ks * kBK) * kElemBytes + cc * 16;
      ptx::cp_async_16(dst + r * (kFp8 ? kBStrideFp8 : kBStrideBf16 * 2) + cc * 16, src, valid ? 16 : 0);
    }
    if (++ld_ks == ksteps) ld_ks = 0, ++ld_t;
    if (++ld_stage == kStages) ld_stage = 0;
  };

  // The latent rows (bf16 cache: cp.async; FP8 / f32: converted through registers). Same group as stage 0.
  {
    const int cpr = p.kv_lora / 8;
    if (p.cache_dtype == DType::kBF16) {
      const auto* cache = static_cast<const __nv_bfloat16*>(p.cache);
      for (int c = tid; c < kBM * cpr; c += kThreads) {
        const int r = c / cpr, cc = c - r * cpr;
        const int64_t slot = row_slot[r];
        ptx::cp_async_16(As + r * as + cc * 8, cache + (slot >= 0 ? slot * width + cc * 8 : 0), slot >= 0 ? 16 : 0);
      }
    } else {
#pragma unroll 4
      for (int c = tid; c < kBM * cpr; c += kThreads) {
        const int r = c / cpr, cc = c - r * cpr;
        const int64_t slot = row_slot[r];
        const uint4 v = slot >= 0 ? load8_as_bf16(p.cache, p.cache_dtype, slot * width + cc * 8) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(As + r * as + cc * 8) = v;
      }
    }
  }
#pragma unroll 1
  for (int s = 0; s < kStages - 1; ++s) {  // groups 0 .. kStages - 2 (group 0 holds the latent rows too)
    if (s < total) load_b();
    ptx::cp_async_commit();
  }

  const bool e8m0 = p.format.scale_e8m0;
  const int kb_steps = kMode == kModeFp8Block ? static_cast<int>(p.format.block_k / kBK) : 1;
  const int64_t k_blocks = kMode == kModeFp8Block ? (p.kv_lora + p.format.block_k - 1) / p.format.block_k : 1;
  float acc[4][4][4];
  float part[4][4][4];
  float col_scale[4][2];
  float blk_scale = 1.0f;

  int t = t_begin, ks = 0, stage = 0;  // the step computed now
#pragma unroll 1
  for (int i = 0; i < total; ++i) {
    const int64_t n0 = int64_t{t} * kBN;
    if (ks == 0) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
      if constexpr (kMode == kModeFp8PerRow) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t n = n0 + wn * 32 + nt * 8 + (lane & 3) * 2 + e;
            col_scale[nt][e] = n < L.n ? load_scale(p.scale, e8m0, n) : 0.0f;
          }
      }
    }
    if constexpr (kMode == kModeFp8Block) {
      if (ks % kb_steps == 0) {
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[mt][nt][e] = 0.0f;
        blk_scale = load_scale(p.scale, e8m0, (n0 / p.format.block_n) * k_blocks + (ks * kBK) / p.format.block_k);
      }
    }
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();  // step i landed for all; the stage step i - 1 used is free
    if (i + kStages - 1 < total) load_b();
    ptx::cp_async_commit();

    const unsigned char* bst = Bs + stage * kStageBytes;
    const int k_base = ks * kBK;
    // Fragments of k slice kk (16 wide) of this stage.
    auto load_frags = [&](int kk, uint32_t (&af)[4][4], uint32_t (&bf)[4][2]) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        ptx::ldmatrix_x4(af[mt], As + (wm * 64 + mt * 16 + (lane & 15)) * as + k_base + kk + (lane >> 4) * 8);
      if constexpr (!kFp8) {
        const auto* bb = reinterpret_cast<const __nv_bfloat16*>(bst);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t r[4];
          ptx::ldmatrix_x4(r, bb + (wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3)) * kBStrideBf16 + kk +
                             ((lane >> 3) & 1) * 8);
          bf[2 * np][0] = r[0];
          bf[2 * np][1] = r[1];
          bf[2 * np + 1][0] = r[2];
          bf[2 * np + 1][1] = r[3];
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const unsigned char* q = bst + (wn * 32 + nt * 8 + (lane >> 2)) * kBStrideFp8 + kk + (lane & 3) * 2;
          bf[nt][0] = fp8x2_to_bf16x2_fast(*reinterpret_cast<const uint16_t*>(q));
          bf[nt][1] = fp8x2_to_bf16x2_fast(*reinterpret_cast<const uint16_t*>(q + 8));
        }
      }
    };
    // Double-buffered fragments: slice s + 1 loads while slice s multiplies.
    uint32_t af[2][4][4], bf[2][4][2];
    load_frags(0, af[0], bf[0]);
#pragma unroll
    for (int sl = 0; sl < kBK / 16; ++sl) {
      if (sl + 1 < kBK / 16) load_frags((sl + 1) * 16, af[(sl + 1) & 1], bf[(sl + 1) & 1]);
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if constexpr (kMode == kModeFp8Block)
            ptx::mma_m16n8k16_bf16_unordered(part[mt][nt], af[sl & 1][mt], bf[sl & 1][nt][0], bf[sl & 1][nt][1]);
          else
            ptx::mma_m16n8k16_bf16_unordered(acc[mt][nt], af[sl & 1][mt], bf[sl & 1][nt][0], bf[sl & 1][nt][1]);
        }
    }
    if constexpr (kMode == kModeFp8Block) {
      if ((ks + 1) % kb_steps == 0 || ks == ksteps - 1) {
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] += part[mt][nt][e] * blk_scale;
      }
    }
    if (++stage == kStages) stage = 0;
    if (++ks != ksteps) continue;
    ks = 0;
    ++t;

    // Epilogue of column tile n0: scaled results -> bf16 pairs -> k (k_nope part) or v.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int64_t n = n0 + wn * 32 + nt * 8 + (lane & 3) * 2;  // even; a pair never straddles k_nope / v
      if (n >= L.n) continue;
      const int64_t h = n / head_kv;
      const int col = static_cast<int>(n - h * head_kv);
      const bool to_k = col < p.qk_nope;
      __nv_bfloat16* base = to_k ? p.k + h * k_row + col : p.v + h * p.v_head + (col - p.qk_nope);
      const int64_t key_stride = int64_t{p.num_heads} * (to_k ? k_row : p.v_head);
      float s0 = L.out_scale, s1 = L.out_scale;
      if constexpr (kMode == kModeFp8PerRow) {
        s0 *= col_scale[nt][0];
        s1 *= col_scale[nt][1];
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = wm * 64 + mt * 16 + (lane >> 2) + half * 8;
          if (r < rows)
            *reinterpret_cast<uint32_t*>(base + (row0 + r) * key_stride) =
                pack_bf16x2(acc[mt][nt][2 * half] * s0, acc[mt][nt][2 * half + 1] * s1);
        }
    }
    // k_pe of the heads whose first column lies in this tile.
    const int cpr = p.qk_rope / 8;
    for (int64_t h = (n0 + head_kv - 1) / head_kv; h < p.num_heads && h * head_kv < n0 + kBN; ++h) {
      for (int c = tid; c < rows * cpr; c += kThreads) {
        const int r = c / cpr, cc = c - r * cpr;
        const uint4 val = load8_scaled(p.cache, p.cache_dtype, row_slot[r] * width + p.kv_lora + cc * 8, L.out_scale);
        *reinterpret_cast<uint4*>(p.k + ((row0 + r) * p.num_heads + h) * k_row + p.qk_nope + cc * 8) = val;
      }
    }
  }
  ptx::cp_async_wait<0>();
}

template <int kMode>
void* kernel_of() {
  return reinterpret_cast<void*>(&gather_kv_b_proj_fused_kernel<kMode>);
}

}  // namespace

int64_t gather_kv_b_proj_fused_smem_bytes(int kv_lora, bool fp8_weight) {
  return kSlotBytes + a_bytes(kv_lora) + int64_t{num_stages(fp8_weight)} * b_stage_bytes(fp8_weight);
}

cudaError_t gather_kv_b_proj_fused_prepare() {
  int dev = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  for (void* k : {kernel_of<kModeBf16>(), kernel_of<kModeFp8PerRow>(), kernel_of<kModeFp8Block>()})
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
  return e;
}

cudaError_t launch_gather_kv_b_proj_fused(const GatherKvBProjParams& p, int num_sms, cudaStream_t stream) {
  if (p.num_keys <= 0) return cudaSuccess;
  FusedLaunch L;
  L.p = p;
  L.n = p.num_heads * (p.qk_nope + p.v_head);
  L.n_tiles = (L.n + kBN - 1) / kBN;
  L.out_scale = p.cache_dtype == DType::kF8E4M3 ? p.k_scale : 1.0f;
  const int64_t m_tiles = (p.num_keys + kBM - 1) / kBM;
  // Column tiles per CTA: fewer CTAs reload fewer latent tiles (~half a
  // tile's time each); more fill the SMs. Minimise waves x CTA time.
  num_sms = std::max(num_sms, 1);
  int best_tpc = L.n_tiles;
  double best_cost = 1e300;
  for (int tpc = 1; tpc <= L.n_tiles; ++tpc) {
    const int64_t ctas = m_tiles * ((L.n_tiles + tpc - 1) / tpc);
    const double cost = static_cast<double>((ctas + num_sms - 1) / num_sms) * (0.5 + tpc);
    if (cost < best_cost) best_cost = cost, best_tpc = tpc;
  }
  L.n_splits = (L.n_tiles + best_tpc - 1) / best_tpc;
  L.tiles_per_cta = (L.n_tiles + L.n_splits - 1) / L.n_splits;
  const bool fp8 = p.format.weight_dtype == DType::kF8E4M3;
  const size_t smem = static_cast<size_t>(gather_kv_b_proj_fused_smem_bytes(p.kv_lora, fp8));
  const dim3 grid(static_cast<unsigned>(m_tiles * L.n_splits));
  if (!fp8) gather_kv_b_proj_fused_kernel<kModeBf16><<<grid, kThreads, smem, stream>>>(L);
  else if (p.format.scale_layout == KvBScaleLayout::kPerRow)
    gather_kv_b_proj_fused_kernel<kModeFp8PerRow><<<grid, kThreads, smem, stream>>>(L);
  else gather_kv_b_proj_fused_kernel<kModeFp8Block><<<grid, kThreads, smem, stream>>>(L);
  return cudaGetLastError();
}

}  // namespace nucleus::kernels
