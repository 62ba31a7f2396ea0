// Inline-PTX wrappers for the sm_90 bulk asynchronous copy (the TMA unit's
// non-tensor form, cp.async.bulk) and the shared-memory mbarrier that
// tracks it. Source of the semantics: the PTX ISA, "Data Movement and
// Conversion Instructions: cp.async.bulk" and "Parallel Synchronization and
// Communication Instructions: mbarrier". The protocol a kernel follows:
//   1. one thread mbarrier_init(bar, n) for each barrier, then
//      fence_mbarrier_init() and a __syncthreads() before any use;
//   2. per phase, n arrivals, each announcing the bytes it will bring:
//      mbarrier_arrive_expect_tx(bar, bytes) (0 bytes: a plain arrival);
//      the copies, bulk_copy_g2s(dst, src, bytes, bar), may be issued
//      before or after the announcement by any thread;
//   3. consumers mbarrier_wait_parity(bar, phase & 1): returns once all n
//      arrivals happened and every announced byte landed; the bytes are
//      then visible to the waiting thread.
// Shared memory written or read by ordinary (generic-proxy) instructions and
// then overwritten by a bulk copy needs fence_proxy_async() between the two
// (after the barrier that orders them). Only for .cu files built for sm_90.
#pragma once

#include <cstdint>

namespace nucleus::kernels::ptx {

// mbarrier.init.shared::cta.b64 [bar], count: a fresh barrier in phase 0
// expecting `count` arrivals a phase. bar: 8-byte aligned shared address.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// fence.mbarrier_init.release.cluster: makes the initialised barriers
// visible to the async proxy (the copy engine) before they are used.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// fence.proxy.async.shared::cta: orders this thread's earlier generic-proxy
// shared-memory accesses before its later async-proxy ones (bulk copies).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// mbarrier.arrive.expect_tx.shared::cta.b64: one arrival on `bar` that also
// raises the phase's pending byte count by `bytes`.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}

// Blocks until the phase of `bar` with parity `parity` (0 for phases 0, 2,
// ...; 1 for 1, 3, ...) has completed (mbarrier.try_wait.parity in a loop).
__device__ __forceinline__ void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// An L2 cache policy (createpolicy.fractional.L2::evict_first, fraction 1):
// lines a copy under it brings into L2 are the first evicted, for data read
// once (a decode step's cache rows) that should not push out what is reused.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes
// .L2::cache_hint: copies `bytes` (a multiple of 16) from global `src` to
// shared `dst` (both 16-byte aligned) through the copy engine, under the L2
// cache policy `policy` (l2_evict_first_policy); on arrival the bytes count
// against the pending byte count of `bar`'s current phase. Issued by one
// thread.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                              uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

}  // namespace nucleus::kernels::ptx
