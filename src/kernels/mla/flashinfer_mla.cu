// Adapter from nucleus' paged latent cache to FlashInfer's Hopper MLA kernel
// (see flashinfer_mla.cuh). Compiled with the FlashInfer include paths only
// when cmake/flashinfer.cmake found the headers; otherwise
// flashinfer_mla_available() is false and the decode dispatch never picks it.
#include "kernels/mla/flashinfer_mla.cuh"

#ifdef NUCLEUS_HAVE_FLASHINFER
#include <flashinfer/attention/mla_hopper.cuh>
#include <flashinfer/attention/scheduler.cuh>

#include <memory>
#include <vector>

namespace nucleus::kernels {

namespace {

using Params = flashinfer::MLAParams<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, int32_t>;

constexpr size_t kIntWorkspaceBytes = 8ull << 20;  // plan arrays

template <typename T>
T* at(void* base, int64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace

// The plan's buffers and the last plan (FlashInferMlaPlan).
struct FlashInferMlaPlan::Impl {
  void* int_buf = nullptr;
  void* int_host = nullptr;  // page-locked staging of the plan
  cudaEvent_t staged = nullptr;
  bool have_plan = false;
  int heads = 0;
  std::vector<int32_t> kv_indptr, kv_len;
  flashinfer::MLAPlanInfo info{};
};

FlashInferMlaPlan::FlashInferMlaPlan() : impl_(std::make_unique<Impl>()) {}

FlashInferMlaPlan::~FlashInferMlaPlan() {
  if (impl_->staged) cudaEventSynchronize(impl_->staged);
  if (impl_->int_buf) cudaFree(impl_->int_buf);
  if (impl_->int_host) cudaFreeHost(impl_->int_host);
  if (impl_->staged) cudaEventDestroy(impl_->staged);
}

cudaError_t FlashInferMlaPlan::plan(const int32_t* row_seq_h, const int32_t* row_keys_h, int64_t n, int num_heads,
                                    int max_blocks, cudaStream_t stream) {
  Impl& ws = *impl_;
  if (!ws.int_buf) {
    cudaError_t e = cudaMalloc(&ws.int_buf, kIntWorkspaceBytes);
    if (e == cudaSuccess) e = cudaMallocHost(&ws.int_host, kIntWorkspaceBytes);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ws.staged, cudaEventDisableTiming);
    if (e != cudaSuccess) return e;
  }
  std::vector<int32_t> kv_indptr(n), kv_len(row_keys_h, row_keys_h + n);
  for (int64_t i = 0; i < n; ++i) kv_indptr[i] = row_seq_h[i] * max_blocks;
  if (ws.have_plan && ws.heads == num_heads && ws.kv_indptr == kv_indptr && ws.kv_len == kv_len)
    return cudaSuccess;
  // The previous plan's copy must have left the staging buffer.
  cudaError_t e = cudaEventSynchronize(ws.staged);
  if (e != cudaSuccess) return e;
  std::vector<int32_t> qo_indptr(n + 1);
  for (int64_t i = 0; i <= n; ++i) qo_indptr[i] = static_cast<int32_t>(i);
  size_t staged_bytes = 0;
  ws.have_plan = false;
  // MLAPlan only lays out offsets into the float workspace (the run's
  // partials), relative to a base it never dereferences; any 256-byte
  // aligned workspace (a cudaMalloc'd arena) then takes them.
  static char* const kFloatBase = reinterpret_cast<char*>(256);
  try {
    e = flashinfer::MLAPlan<int32_t>(kFloatBase, kFlashInferMlaFloatWorkspaceBytes, ws.int_buf, ws.int_host,
                                     kIntWorkspaceBytes, ws.info, staged_bytes, qo_indptr.data(),
                                     kv_indptr.data(), kv_len.data(), static_cast<uint32_t>(n),
                                     static_cast<uint32_t>(num_heads), 512, /*causal=*/false, stream);
  } catch (const std::exception&) {
    return cudaErrorInvalidValue;  // FlashInfer refused the plan (workspace too small, too many works)
  }
  if (e != cudaSuccess) return e;
  e = cudaMemcpyAsync(ws.int_buf, ws.int_host, staged_bytes, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaEventRecord(ws.staged, stream);
  if (e != cudaSuccess) return e;
  ws.have_plan = true;
  ws.heads = num_heads;
  ws.kv_indptr = std::move(kv_indptr);
  ws.kv_len = std::move(kv_len);
  return cudaSuccess;
}

bool flashinfer_mla_available() { return true; }

cudaError_t flashinfer_mla_decode(const FlashInferMlaPlan& plan, const FlashInferMlaParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  const FlashInferMlaPlan::Impl& ws = *plan.impl();
  if (!ws.have_plan || ws.heads != p.num_heads || static_cast<int64_t>(ws.kv_len.size()) != p.num_rows ||
      !p.float_workspace)
    return cudaErrorInvalidValue;
  const flashinfer::MLAPlanInfo& info = ws.info;
  void* ib = ws.int_buf;
  Params params;
  params.q_nope = const_cast<__nv_bfloat16*>(p.q_full);
  params.q_pe = const_cast<__nv_bfloat16*>(p.q_full) + 512;
  params.ckv = const_cast<__nv_bfloat16*>(p.cache);
  params.kpe = const_cast<__nv_bfloat16*>(p.cache) + 512;
  params.q_indptr = at<int32_t>(ib, info.q_indptr_offset);
  params.kv_indptr = at<int32_t>(ib, info.kv_indptr_offset);
  params.partial_indptr = at<int32_t>(ib, info.partial_indptr_offset);
  params.kv_indices = const_cast<int32_t*>(p.block_tables);
  params.q_len = at<int32_t>(ib, info.q_len_offset);
  params.kv_len = at<int32_t>(ib, info.kv_len_offset);
  params.q_start = at<int32_t>(ib, info.q_start_offset);
  params.kv_start = at<int32_t>(ib, info.kv_start_offset);
  params.kv_end = at<int32_t>(ib, info.kv_end_offset);
  params.work_indptr = at<int32_t>(ib, info.work_indptr_offset);
  params.merge_packed_offset_start = at<int32_t>(ib, info.merge_packed_offset_start_offset);
  params.merge_packed_offset_end = at<int32_t>(ib, info.merge_packed_offset_end_offset);
  params.merge_partial_packed_offset_start = at<int32_t>(ib, info.merge_partial_packed_offset_start_offset);
  params.merge_partial_packed_offset_end = at<int32_t>(ib, info.merge_partial_packed_offset_end_offset);
  params.merge_partial_stride = at<int32_t>(ib, info.merge_partial_stride_offset);
  params.final_o = p.o_lat;
  params.final_lse = nullptr;
  // Offsets relative to the (256-byte aligned) base the plan was given.
  params.partial_o = at<__nv_bfloat16>(p.float_workspace, info.partial_o_offset);
  params.partial_lse = at<float>(p.float_workspace, info.partial_lse_offset);
  params.num_heads = flashinfer::uint_fastdiv(static_cast<uint32_t>(p.num_heads));
  params.block_size = flashinfer::uint_fastdiv(static_cast<uint32_t>(p.block_size));
  const uint32_t q_row = static_cast<uint32_t>(p.num_heads) * 576, kv_row = 576;
  params.q_nope_stride_n = q_row;
  params.q_nope_stride_h = 576;
  params.q_pe_stride_n = q_row;
  params.q_pe_stride_h = 576;
  params.ckv_stride_page = kv_row * static_cast<uint32_t>(p.block_size);
  params.ckv_stride_n = kv_row;
  params.kpe_stride_page = kv_row * static_cast<uint32_t>(p.block_size);
  params.kpe_stride_n = kv_row;
  params.o_stride_n = static_cast<uint32_t>(p.num_heads) * 512;
  params.o_stride_h = 512;
  params.sm_scale = p.scale;
  params.return_lse_base_on_e = false;
  return flashinfer::mla::BatchMLAPageAttentionHopper<flashinfer::MaskMode::kNone, 512, 64, Params>(
      params, static_cast<uint32_t>(info.num_blks_x), static_cast<uint32_t>(info.num_blks_y), stream);
}

}  // namespace nucleus::kernels

#else  // no FlashInfer headers in this build

namespace nucleus::kernels {
struct FlashInferMlaPlan::Impl {};
FlashInferMlaPlan::FlashInferMlaPlan() : impl_(std::make_unique<Impl>()) {}
FlashInferMlaPlan::~FlashInferMlaPlan() = default;
cudaError_t FlashInferMlaPlan::plan(const int32_t*, const int32_t*, int64_t, int, int, cudaStream_t) {
  return cudaErrorNotSupported;
}
bool flashinfer_mla_available() { return false; }
cudaError_t flashinfer_mla_decode(const FlashInferMlaPlan&, const FlashInferMlaParams&, cudaStream_t) {
  return cudaErrorNotSupported;
}
}  // namespace nucleus::kernels

#endif
