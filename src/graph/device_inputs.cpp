#include "graph/device_inputs.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <cstring>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"

namespace nucleus {

DeviceInputUploader::~DeviceInputUploader() {
  if (host_) cudaFreeHost(host_);
  if (dev_) cudaFree(dev_);
}

DeviceStepInputs DeviceInputUploader::upload(const StepInputs& in) {
  std::vector<int32_t> token_seq(in.num_tokens()), single_rows;
  for (int64_t s = 0; s < in.num_seqs(); ++s) {
    for (int32_t r = in.query_start[s]; r < in.query_start[s + 1]; ++r) token_seq[r] = static_cast<int32_t>(s);
    if (in.query_len(s) == 1) single_rows.push_back(in.query_start[s]);
  }
  struct Part {
    const void* src;
    size_t bytes;
    size_t offset;
  };
  std::vector<Part> parts = {
      {in.token_ids.data(), in.token_ids.size() * 4, 0},
      {in.positions.data(), in.positions.size() * 4, 0},
      {in.slot_mapping.data(), in.slot_mapping.size() * 8, 0},
      {in.query_start.data(), in.query_start.size() * 4, 0},
      {in.context_lens.data(), in.context_lens.size() * 4, 0},
      {in.block_tables.data(), in.block_tables.size() * 4, 0},
      {in.logit_indices.data(), in.logit_indices.size() * 4, 0},
      {token_seq.data(), token_seq.size() * 4, 0},
      {single_rows.data(), single_rows.size() * 4, 0},
  };
  size_t total = 0;
  for (auto& p : parts) {
    p.offset = total;
    total += (p.bytes + 15) / 16 * 16;
  }
  cudaStream_t stream = cuda::context().stream;
  if (total > capacity_) {
    NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (host_) NUCLEUS_CUDA_CHECK(cudaFreeHost(host_));
    if (dev_) NUCLEUS_CUDA_CHECK(cudaFree(dev_));
    capacity_ = std::max<size_t>(total * 2, 1 << 16);
    NUCLEUS_CUDA_CHECK(cudaMallocHost(&host_, capacity_));
    NUCLEUS_CUDA_CHECK(cudaMalloc(&dev_, capacity_));
  }
  // The previous step's copy has completed: the engine synchronises at the
  // end of every step (logits to the host).
  for (const auto& p : parts)
    if (p.bytes) std::memcpy(static_cast<char*>(host_) + p.offset, p.src, p.bytes);
  NUCLEUS_CUDA_CHECK(cudaMemcpyAsync(dev_, host_, total, cudaMemcpyHostToDevice, stream));
  auto at = [&](int i) { return static_cast<char*>(dev_) + parts[i].offset; };
  DeviceStepInputs d;
  d.token_ids = reinterpret_cast<const int32_t*>(at(0));
  d.positions = reinterpret_cast<const int32_t*>(at(1));
  d.slot_mapping = reinterpret_cast<const int64_t*>(at(2));
  d.query_start = reinterpret_cast<const int32_t*>(at(3));
  d.context_lens = reinterpret_cast<const int32_t*>(at(4));
  d.block_tables = reinterpret_cast<const int32_t*>(at(5));
  d.logit_indices = reinterpret_cast<const int32_t*>(at(6));
  d.token_seq = reinterpret_cast<const int32_t*>(at(7));
  d.single_token_rows = reinterpret_cast<const int32_t*>(at(8));
  d.num_single_token_rows = static_cast<int64_t>(single_rows.size());
  return d;
}

}  // namespace nucleus
#else
namespace nucleus {
DeviceInputUploader::~DeviceInputUploader() = default;
DeviceStepInputs DeviceInputUploader::upload(const StepInputs&) { return {}; }
}  // namespace nucleus
#endif
