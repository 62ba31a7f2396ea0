// Inline-PTX wrappers shared by the tensor-core kernels (GEMM, MLA, MoE):
// asynchronous global -> shared copies, ldmatrix fragment loads and the bf16
// mma.sync. One definition each; all are __forceinline__ so a call compiles
// to the bare instruction. Fragment layouts follow the PTX ISA ("Warp-level
// matrix fragments for mma.m16n8k16"): with g = lane / 4 and t = lane % 4,
//   A (16 x 16, row-major): a[0] rows g,   k 2t..2t+1;  a[1] rows g+8, k 2t..2t+1;
//                           a[2] rows g,   k 2t+8..+9;  a[3] rows g+8, k 2t+8..+9
//   B (16 x 8, "col"):      b0 k 2t..2t+1, column g;    b1 k 2t+8..+9, column g
//   C/D (16 x 8, f32):      d[0..1] row g, columns 2t, 2t+1; d[2..3] row g+8
// (two bf16 per 32-bit register, the lower k / column in the low half).
// Only for .cu files (device code, sm_80+; cp.async and ldmatrix need sm_80).
#pragma once

#include <cstdint>

namespace nucleus::kernels::ptx {

// The 32-bit shared-state-space address of a generic pointer into shared
// memory (cvta.to.shared), as cp.async and ldmatrix take it.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: copies 16 bytes
// global -> shared asynchronously, bypassing L1; the 16 - src_bytes trailing
// bytes are zero-filled (src_bytes 0: nothing is read, `src` must still be a
// valid address). dst and src 16-byte aligned. Completes at cp_async_wait.
// The "memory" clobber keeps the compiler from moving ordinary memory
// accesses across the issue.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  cp_async_16(smem_u32(dst), src, src_bytes);
}

// cp.async.ca.shared.global [dst], [src], 4, src_bytes: the same for 4 bytes
// (src_bytes 0 or 4; 4-byte aligned), through L1.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// cp.async.commit_group: closes the group of this thread's cp.async issued
// since the previous commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// cp.async.wait_group N: waits until at most N of this thread's committed
// groups are still in flight. Visibility to other threads needs a barrier
// (__syncthreads / __syncwarp) after it. The "memory" clobber keeps later
// shared-memory reads after the wait.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 b16 matrices from
// shared memory; lanes 8i..8i+7 give the row addresses (16 bytes each) of
// matrix i, and r_i receives matrix i in the mma fragment layout (lane l holds
// row l / 4, columns 2 (l % 4), +1). Warp-collective.
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  ldmatrix_x4(smem_u32(p), r[0], r[1], r[2], r[3]);
}

// ldmatrix.sync.aligned.m8n8.x2.shared.b16: two 8x8 b16 matrices; lanes
// 8i..8i+7 (i = 0, 1) give the row addresses of matrix i (the addresses of
// lanes 16..31 are not read), r_i receives matrix i in the fragment layout.
__device__ __forceinline__ void ldmatrix_x2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr) : "memory");
}
// The same, each matrix transposed (.trans): lane l holds column l / 4,
// rows 2 (l % 4), +1 — the B fragment of a row-major [k, n] tile.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

#define NUCLEUS_PTX_MMA_M16N8K16_BF16                                                               \
  "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, " \
  "{%0, %1, %2, %3};\n"

// d (16 x 8, f32) += a (16 x 16, bf16, row) * b (16 x 8, bf16, col):
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, fragments as in the
// file comment. Warp-collective. Emitted as `asm volatile`, i.e. kept in
// program order with the other volatile asm (the fragment loads).
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(NUCLEUS_PTX_MMA_M16N8K16_BF16
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same MMA as a plain (non-volatile) asm: a pure register operation, so
// the compiler may interleave it with the (volatile) fragment loads of the
// next k slice. Same results; for kernels tuned with that freedom.
__device__ __forceinline__ void mma_m16n8k16_bf16_unordered(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1) {
  asm(NUCLEUS_PTX_MMA_M16N8K16_BF16
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#undef NUCLEUS_PTX_MMA_M16N8K16_BF16

// d (16 x 8, f32) += a (16 x 16, f16, row) * b (16 x 8, f16, col):
// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, the fragments laid out
// as the bf16 MMA's (two f16 per register, the lower k in the low half).
// Plain asm, as mma_m16n8k16_bf16_unordered.
__device__ __forceinline__ void mma_m16n8k16_f16_unordered(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                           uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace nucleus::kernels::ptx
