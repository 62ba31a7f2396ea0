// FlashInfer's MLA decode kernel (Hopper path, flashinfer/attention/
// mla_hopper.cuh, header-only, fetched by tools/fetch_flashinfer.sh) behind a
// framework-free call. It computes the attention part of absorbed MLA:
//   o_lat[i, h, :] = softmax_j(scale * (q_lat[i, h] . c_j + q_pe[i, h] . k_pe_j)) . c_j
// over the keys 0 .. row_keys_h[i] - 1 of sequence row_seq_h[i], given the
// absorbed query q_full = [q_lat | q_pe].
//
// Each query row is planned as its own request (query length 1), so prefill
// rows of a forced-absorbed step work too. FlashInfer plans on the host from
// the rows' key counts (MLAPlan) and stages the plan with one async copy: a
// FlashInferMlaPlan, made once per step and batch of rows and read by every
// layer's flashinfer_mla_decode. A host plan cannot follow a CUDA graph's
// replays: a graph that captures the decode launches replays the plan made
// before the capture.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

namespace nucleus::kernels {

struct FlashInferMlaParams {
  int num_heads = 0;
  float scale = 0.0f;  // softmax scale (ModelConfig::softmax_scale)
  int64_t num_rows = 0;
  const __nv_bfloat16* q_full = nullptr;  // [num_rows, num_heads, 576]: q_lat (512) | q_pe (64)
  const __nv_bfloat16* cache = nullptr;   // this layer: [num_slots, 576] rows [c_kv | k_pe]
  int block_size = 0;
  const int32_t* block_tables = nullptr;  // device [num_seqs, max_blocks]
  __nv_bfloat16* o_lat = nullptr;         // [num_rows, num_heads, 512]
  // Device scratch of kFlashInferMlaFloatWorkspaceBytes: the split partial
  // outputs and LSEs (contents not kept between calls).
  void* float_workspace = nullptr;
};

// Device bytes of FlashInferMlaParams::float_workspace.
constexpr size_t kFlashInferMlaFloatWorkspaceBytes = size_t{64} << 20;

// Whether this build has the FlashInfer headers (NUCLEUS_FLASHINFER).
bool flashinfer_mla_available();

// FlashInfer's schedule of one batch of query rows over their keys (MLAPlan),
// staged on the device: plan() once per step and batch, then any number of
// flashinfer_mla_decode calls (one per layer) for those rows.
class FlashInferMlaPlan {
 public:
  FlashInferMlaPlan();
  ~FlashInferMlaPlan();  // frees its buffers (after the device is done with them: the caller syncs)
  FlashInferMlaPlan(const FlashInferMlaPlan&) = delete;
  FlashInferMlaPlan& operator=(const FlashInferMlaPlan&) = delete;
  // Plans `num_rows` rows: row i is a query of sequence row_seq_h[i] (host)
  // that sees its keys 0 .. row_keys_h[i] - 1 (>= 1), with `num_heads` heads,
  // block tables `max_blocks` wide; reuses the previous plan when they are the
  // same. The first call allocates the plan's 8 MiB device and page-locked
  // buffers (kept until destruction). Stages the plan with an async copy on
  // `stream`. Not under CUDA-graph capture (host work). Errors:
  // cudaErrorNotSupported without FlashInfer, cudaErrorInvalidValue when
  // FlashInfer refuses the batch, or the failing CUDA call's error.
  cudaError_t plan(const int32_t* row_seq_h, const int32_t* row_keys_h, int64_t num_rows, int num_heads,
                   int max_blocks, cudaStream_t stream);

  struct Impl;
  const Impl* impl() const { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

// Runs the attention of the rows `plan` was last planned for (p.num_rows of
// them, p.num_heads heads) on `stream`; capturable (launches only).
// cudaErrorNotSupported when the build has no FlashInfer; cudaErrorInvalidValue
// when `plan` was never planned or p disagrees with it.
cudaError_t flashinfer_mla_decode(const FlashInferMlaPlan& plan, const FlashInferMlaParams& p, cudaStream_t stream);

}  // namespace nucleus::kernels
