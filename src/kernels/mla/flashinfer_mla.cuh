// FlashInfer's MLA decode kernel (Hopper path, flashinfer/attention/
// mla_hopper.cuh, header-only, fetched by tools/fetch_flashinfer.sh) behind a
// framework-free call. It computes the attention part of absorbed MLA:
//   o_lat[i, h, :] = softmax_j(scale * (q_lat[i, h] . c_j + q_pe[i, h] . k_pe_j)) . c_j
// over the keys 0 .. row_keys_h[i] - 1 of sequence row_seq_h[i], given the
// absorbed query q_full = [q_lat | q_pe].
//
// Each query row is planned as its own request (query length 1), so prefill
// rows of a forced-absorbed step work too. FlashInfer plans on the host from
// the rows' key counts (MLAPlan) and stages the plan with one async copy; a
// plan equal to the previous call's is reused (the layers of one step share
// it). A host plan cannot follow a CUDA graph's replays, so under capture the
// call refuses (the op then runs the nucleus kernel instead).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

struct FlashInferMlaParams {
  int num_heads = 0;
  float scale = 0.0f;  // softmax scale (ModelConfig::softmax_scale)
  int64_t num_rows = 0;
  const __nv_bfloat16* q_full = nullptr;  // [num_rows, num_heads, 576]: q_lat (512) | q_pe (64)
  const __nv_bfloat16* cache = nullptr;   // this layer: [num_slots, 576] rows [c_kv | k_pe]
  int block_size = 0;
  const int32_t* block_tables = nullptr;  // device [num_seqs, max_blocks]
  int max_blocks = 0;
  const int32_t* row_seq_h = nullptr;   // host [num_rows]: sequence of each row
  const int32_t* row_keys_h = nullptr;  // host [num_rows]: keys the row sees (>= 1)
  __nv_bfloat16* o_lat = nullptr;       // [num_rows, num_heads, 512]
};

// Whether this build has the FlashInfer headers (NUCLEUS_FLASHINFER).
bool flashinfer_mla_available();

// Runs on `stream`. The first call allocates FlashInfer's workspaces (kept
// for the process). cudaErrorNotSupported when the build has no FlashInfer;
// cudaErrorStreamCaptureUnsupported when `stream` is capturing a CUDA graph
// (a replay would reuse the captured plan whatever the key counts), unless
// flashinfer_mla_set_capture_static(true) promised that every replay has the
// captured rows and key counts (benchmarks).
cudaError_t flashinfer_mla_decode(const FlashInferMlaParams& p, cudaStream_t stream);
void flashinfer_mla_set_capture_static(bool static_plan);

}  // namespace nucleus::kernels
