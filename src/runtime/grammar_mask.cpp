#include "runtime/grammar_mask.h"

#include <algorithm>

#include "core/check.h"
#include "runtime/structured_output.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/context.h"
#include "kernels/sampling/token_bitmask.cuh"
#include "ops/op_cuda_check.h"
#endif

namespace nucleus {

GrammarMasker::~GrammarMasker() {
#ifdef NUCLEUS_HAVE_CUDA
  if (d_bitmask_) cudaFree(d_bitmask_);
  if (d_row_ids_) cudaFree(d_row_ids_);
#endif
}

void GrammarMasker::apply(const std::vector<const Sequence*>& rows, float* logits, int64_t vocab, Device device) {
  const int64_t words = token_bitmask_words(vocab);
  matchers_.clear();
  row_ids_.clear();
  for (size_t r = 0; r < rows.size(); ++r) {
    if (GrammarMatcher* m = rows[r]->grammar_matcher.get()) {
      NUCLEUS_CHECK(m->vocab_size() == vocab, "grammar vocab {} != logits width {}", m->vocab_size(), vocab);
      matchers_.push_back(m);
      row_ids_.push_back(static_cast<int32_t>(r));
    }
  }
  if (row_ids_.empty()) return;
  bitmask_.resize(row_ids_.size() * words);
  GrammarMatcher::fill_next_token_bitmasks(matchers_, bitmask_.data());
  if (device != Device::kCuda) {
    for (size_t i = 0; i < row_ids_.size(); ++i)
      apply_token_bitmask(logits + static_cast<int64_t>(row_ids_[i]) * vocab, bitmask_.data() + i * words, vocab);
    return;
  }
#ifdef NUCLEUS_HAVE_CUDA
  const int64_t n = static_cast<int64_t>(row_ids_.size());
  if (n > d_rows_ || words != d_words_) {
    if (d_bitmask_) cudaFree(d_bitmask_);
    if (d_row_ids_) cudaFree(d_row_ids_);
    d_bitmask_ = d_row_ids_ = nullptr;
    d_rows_ = 0;
    const int64_t cap = std::max<int64_t>(n, 64);
    NUCLEUS_OP_CUDA_CHECK(cudaMalloc(&d_bitmask_, cap * words * sizeof(int32_t)));
    NUCLEUS_OP_CUDA_CHECK(cudaMalloc(&d_row_ids_, cap * sizeof(int32_t)));
    d_rows_ = cap;
    d_words_ = words;
  }
  cudaStream_t stream = cuda::context().stream;
  // Pageable sources: the copies return once the bytes are staged, so the
  // host vectors may be refilled by the next step.
  NUCLEUS_OP_CUDA_CHECK(cudaMemcpyAsync(d_bitmask_, bitmask_.data(), n * words * sizeof(int32_t),
                                        cudaMemcpyHostToDevice, stream));
  NUCLEUS_OP_CUDA_CHECK(
      cudaMemcpyAsync(d_row_ids_, row_ids_.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_apply_token_bitmask(logits, vocab, static_cast<const int32_t*>(d_bitmask_),
                                                            static_cast<const int32_t*>(d_row_ids_), n, stream));
#else
  NUCLEUS_CHECK(false, "grammar masks for device logits in a CPU-only build");
#endif
}

FinishReason advance_grammar(Sequence& seq, int32_t token) {
  GrammarMatcher& m = *seq.grammar_matcher;
  if (!m.accept_token(token)) {
    seq.error = internal_error("structured output: the grammar refused sampled token " + std::to_string(token) +
                               " at output position " + std::to_string(seq.num_output_tokens() - 1));
    return FinishReason::kError;
  }
  return m.is_terminated() ? FinishReason::kStop : FinishReason::kNone;
}

}  // namespace nucleus
