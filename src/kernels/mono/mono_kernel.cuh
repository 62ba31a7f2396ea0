// The persistent kernel that runs a decode program (mono_program.h) on
// Hopper (sm_90a): one CTA per SM, each running its job queue.
//
// A CTA is one copy warp and eight compute warps:
//  - the copy warp streams the weight chunks of every job of its queue, in
//    queue order, into a ring of shared-memory slots (cp.async.bulk, one bulk
//    copy per weight row, completion on an mbarrier per slot; an L2
//    evict-first policy). Weights depend on nothing the step computes, so it
//    never waits for a job's inputs: while the compute warps wait for the
//    stage before, the next stage's weights are already arriving (up to
//    mono_ring_slots chunks ahead);
//  - the compute warps, per job: wait until every job of the stages in its
//    wait_mask has finished (one thread polls those stages' counters with
//    ld.acquire.gpu), build x (the step's rows, at most 8) in shared memory
//    by the stage's prologue, then per 16-row group of weight rows and 512-k
//    slice run mma.sync m16n8k16 (the weight rows as A from the slot, the
//    rows of x as B: "swap AB", so 1 ... 8 rows cost the same), each warp 64
//    of the slice's k; the eight warps' partial products are added in a fixed
//    order (bit-identical from launch to launch); then the epilogue writes the
//    job's columns; after its last job of a stage the CTA adds its count of
//    them to the stage's counter (Program::release_counters).
//    A kSelect job routes one row a warp (warp-wide arg-max rounds) and writes
//    the route table; a kCombine job sums the routed outputs by the table;
//  - routed jobs: the copy warp waits for the route table (the select stage's
//    counter; the only wait it makes) to learn its slot's expert, and streams
//    nothing for a slot the rows left unused, exactly as the compute warps
//    skip it.
// The last CTA to finish sets the counters back to zero for the next launch.
// A wait that lasts 10 s (a program that cannot finish) traps instead of
// hanging (the launch then fails with cudaErrorLaunchFailure).
//
// Shared memory: the ring (mono_ring_slots(p)
// slots of 16 rows x 1,040 bytes), x (8 rows of k_max + 8 bf16, k_max the
// widest stage), the cross-warp sums and the job's output tile. PDL: the CTAs
// start streaming weights at once and wait for the kernel before
// (griddepcontrol.wait) before reading activations, counters or a route
// table. Callers keep docs/decode_program.md's constraints: every CTA
// resident at once, and a launch sharing counters ordered after the last.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "kernels/mono/mono_program.h"

namespace nucleus::kernels::mono {

// Ring slots the kernel uses for `p` (3 ... 12: as many as fit beside x).
int mono_ring_slots(const Program& p);

// Launches `p` on `stream` (a programmatic dependent of the kernel before when
// `pdl`). Errors: cudaErrorInvalidValue for a program the kernel cannot run
// (width not 1, 2, 4 or 8, rows outside 1 ... width, no stages or more than
// kMaxStages, null queues or counters, num_ctas above the SMs: every CTA must
// be resident at once), launch errors. The plan must come from plan_program
// (mono_program_ref.h), which checks every stage.
cudaError_t launch_mono_program(const Program& p, cudaStream_t stream, bool pdl);

// Diagnostic variants for the benchmark (bench/mono_bench.cpp --probe; the
// engine never sets them), to find what limits the kernel's streaming
// (docs/perf.md "Decode programs: the first GPU run": ~1.1 TB/s):
//   copy_only    the compute warps wait for each chunk and free it but skip
//                the MMAs: the rate the copy path alone reaches;
//   cp_async     the copy warp's 32 lanes copy each chunk with 16-byte
//                cp.async (LDGSTS, L2-only) and signal the slot's barrier with
//                cp.async.mbarrier.arrive, instead of one cp.async.bulk a row;
//   max_slots    at most this many ring slots (0: as many as fit);
//   rotate       CTA c streams each group's slices starting at slice
//                c % slices (the sums' order changes, so the low bits may);
//   packed_rows  copy_only only: rows land at a 1,024-byte pitch (128-byte
//                aligned destinations) instead of kRowPitch's 1,040;
//   contiguous   copy_only only: one bulk copy a chunk of the chunk's bytes
//                of the group's contiguous rows (the same bytes a job
//                streams, read as one run instead of 16 rows' slices);
//   no_hint      the bulk copies carry no L2 evict-first policy;
//   timeline     when set, CTA c writes %globaltimer (ns) to timeline[c *
//                kTimelineFields + i]: i = 0 start, 1 the compute warps'
//                inputs ready (the PDL wait), 2 the first chunk landed, 3 the
//                last chunk landed, 4 the compute warps done, 5 the copy warp
//                done issuing; for its queue's job j < kTimelineJobs: 6 + 4 j
//                the job's waits done, 7 + 4 j its x built (a GEMV that builds
//                one), 8 + 4 j its last chunk used (a GEMV), 9 + 4 j its
//                outputs stored (and, with fence counters or as the CTA's
//                last job of the stage, counted);
//   packed_rows and contiguous need copy_only (cudaErrorInvalidValue else).
// Results are the program's (copy_only: the outputs are not computed).
inline constexpr int kTimelineJobs = 24;
inline constexpr int kTimelineFields = 6 + 4 * kTimelineJobs;
struct MonoProbe {
  bool copy_only = false;
  bool cp_async = false;
  int max_slots = 0;
  bool rotate = false;
  bool packed_rows = false;
  bool contiguous = false;
  bool no_hint = false;
  unsigned long long* timeline = nullptr;  // [num_ctas][kTimelineFields] on the device
};
cudaError_t launch_mono_program(const Program& p, cudaStream_t stream, bool pdl, const MonoProbe& probe);
// The ring slots a launch with `probe` uses.
int mono_ring_slots(const Program& p, const MonoProbe& probe);

}  // namespace nucleus::kernels::mono
