#include "graph/device_inputs.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "ops/op_cuda_check.h"

namespace nucleus {

DeviceInputUploader::~DeviceInputUploader() {
  for (int h = 0; h < 2; ++h) {
    if (host_[h]) cudaFreeHost(host_[h]);
    if (copied_[h]) cudaEventDestroy(static_cast<cudaEvent_t>(copied_[h]));
  }
  if (dev_) cudaFree(dev_);
}

namespace {
// Region order: token_ids, positions, slot_mapping, query_start, context_lens,
// block_tables, logit_indices, token_seq, single_token_rows.
size_t region_bytes(const DeviceInputUploader::Capacity& c, int i) {
  switch (i) {
    case 0: case 1: case 7: return c.tokens * 4;
    case 2: return c.tokens * 8;
    case 3: return (c.seqs + 1) * 4;
    case 4: case 8: return c.seqs * 4;
    case 5: return c.block_table_entries * 4;
    case 6: return c.logits * 4;
  }
  return 0;
}
}  // namespace

void DeviceInputUploader::layout() {
  size_t total = 0;
  for (int i = 0; i < 9; ++i) {
    offsets_[i] = total;
    total += (region_bytes(cap_, i) + 255) / 256 * 256;
  }
  offsets_[9] = total;
  cudaStream_t stream = cuda::context().stream;
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int h = 0; h < 2; ++h) {
    if (host_[h]) NUCLEUS_CUDA_CHECK(cudaFreeHost(host_[h]));
    if (!copied_[h]) {
      cudaEvent_t e;
      NUCLEUS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      copied_[h] = e;
    }
  }
  if (dev_) NUCLEUS_CUDA_CHECK(cudaFree(dev_));
  bytes_ = std::max<size_t>(total, 256);
  for (int h = 0; h < 2; ++h) NUCLEUS_CUDA_CHECK(cudaMallocHost(&host_[h], bytes_));
  NUCLEUS_CUDA_CHECK(cudaMalloc(&dev_, bytes_));
  ++generation_;
}

void DeviceInputUploader::reserve(const Capacity& cap) {
  if (dev_ && cap.tokens <= cap_.tokens && cap.seqs <= cap_.seqs &&
      cap.block_table_entries <= cap_.block_table_entries && cap.logits <= cap_.logits)
    return;
  cap_.tokens = std::max(cap_.tokens, cap.tokens);
  cap_.seqs = std::max(cap_.seqs, cap.seqs);
  cap_.block_table_entries = std::max(cap_.block_table_entries, cap.block_table_entries);
  cap_.logits = std::max(cap_.logits, cap.logits);
  layout();
}

DeviceStepInputs DeviceInputUploader::upload(const StepInputs& in, bool packed) {
  std::vector<int32_t> token_seq(in.num_tokens()), single_rows;
  for (int64_t s = 0; s < in.num_seqs(); ++s) {
    for (int32_t r = in.query_start[s]; r < in.query_start[s + 1]; ++r) token_seq[r] = static_cast<int32_t>(s);
    if (in.query_len(s) == 1) single_rows.push_back(in.query_start[s]);
  }
  if (!dev_ || in.num_tokens() > cap_.tokens || in.num_seqs() > cap_.seqs ||
      static_cast<int64_t>(in.block_tables.size()) > cap_.block_table_entries || in.num_logits() > cap_.logits) {
    Capacity c;
    c.tokens = std::max<int64_t>(in.num_tokens(), cap_.tokens);
    c.seqs = std::max<int64_t>(in.num_seqs(), cap_.seqs);
    c.block_table_entries = std::max<int64_t>(static_cast<int64_t>(in.block_tables.size()), cap_.block_table_entries);
    c.logits = std::max<int64_t>(in.num_logits(), cap_.logits);
    reserve(c);
  }
  const void* src[9] = {in.token_ids.data(),    in.positions.data(),    in.slot_mapping.data(),
                        in.query_start.data(),  in.context_lens.data(), in.block_tables.data(),
                        in.logit_indices.data(), token_seq.data(),      single_rows.data()};
  const size_t len[9] = {in.token_ids.size() * 4,    in.positions.size() * 4,    in.slot_mapping.size() * 8,
                         in.query_start.size() * 4,  in.context_lens.size() * 4, in.block_tables.size() * 4,
                         in.logit_indices.size() * 4, token_seq.size() * 4,      single_rows.size() * 4};
  // Packed: the regions by this step's lengths, 256-byte aligned, each no
  // longer than its capacity region (so within the capacity layout).
  size_t packed_offsets[10] = {};
  const size_t* offsets = offsets_;
  if (packed) {
    size_t total = 0;
    for (int i = 0; i < 9; ++i) {
      packed_offsets[i] = total;
      total += (len[i] + 255) / 256 * 256;
    }
    packed_offsets[9] = total;
    NUCLEUS_CHECK(total <= offsets_[9], "packed upload of {} bytes exceeds the capacity layout's {}", total,
                  offsets_[9]);
    offsets = packed_offsets;
  }
  // The half about to be rewritten was last read by copies two uploads ago;
  // wait until they have run (usually long since).
  cudaStream_t stream = cuda::context().stream;
  char* host = static_cast<char*>(host_[next_]);
  cudaEvent_t copied = static_cast<cudaEvent_t>(copied_[next_]);
  NUCLEUS_OP_CUDA_CHECK(cudaEventSynchronize(copied));  // the step's uploads: a failure is the step's error
  size_t end = 0;  // packed: the end of the last non-empty region
  for (int i = 0; i < 9; ++i) {
    if (!len[i]) continue;
    std::memcpy(host + offsets[i], src[i], len[i]);
    end = offsets[i] + len[i];
    if (!packed)
      NUCLEUS_OP_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dev_) + offsets[i], host + offsets[i], len[i],
                                            cudaMemcpyHostToDevice, stream));
  }
  if (packed && end > 0)  // one copy, the gaps between regions included
    NUCLEUS_OP_CUDA_CHECK(cudaMemcpyAsync(dev_, host, end, cudaMemcpyHostToDevice, stream));
  NUCLEUS_OP_CUDA_CHECK(cudaEventRecord(copied, stream));
  next_ ^= 1;
  auto at = [&](int i) { return static_cast<char*>(dev_) + offsets[i]; };
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
void DeviceInputUploader::layout() {}
void DeviceInputUploader::reserve(const Capacity&) {}
DeviceStepInputs DeviceInputUploader::upload(const StepInputs&, bool) { return {}; }
}  // namespace nucleus
#endif
