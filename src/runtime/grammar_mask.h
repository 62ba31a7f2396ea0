// GrammarMasker: applies the grammar masks of a step's sampling rows
// (structured output: Sequence::grammar_matcher, runtime/structured_output.h)
// to their logits before sampling. Rows without a matcher are left as they
// are, so a step without structured-output requests costs nothing. The masks
// are filled on the host (GrammarMatcher::fill_next_token_bitmasks: threads
// for larger batches), on the engine thread, each step.
//   host logits: each masked row in place (apply_token_bitmask);
//   CUDA logits: the masks are filled on the host, uploaded (one copy of
//     [masked rows, ceil(vocab / 32)] int32 plus their row ids) and applied
//     by kernels/sampling/token_bitmask.cuh on the engine stream, ahead of the
//     device sampler on the same stream.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/status.h"
#include "runtime/sequence.h"
#include "runtime/structured_output.h"

namespace nucleus {

class GrammarMasker {
 public:
  GrammarMasker() = default;
  ~GrammarMasker();
  GrammarMasker(const GrammarMasker&) = delete;
  GrammarMasker& operator=(const GrammarMasker&) = delete;

  // rows: the step's sampling sequences in logits-row order; logits:
  // [rows.size(), vocab] f32 on `device`, row stride vocab. Each matcher's
  // vocab_size() must be `vocab` (checked). CUDA: stream-async on the engine
  // stream, not graph-capturable (uploads); a failed CUDA call throws
  // OpCudaError (the step's error).
  void apply(const std::vector<const Sequence*>& rows, float* logits, int64_t vocab, Device device);

 private:
  std::vector<GrammarMatcher*> matchers_;  // of the masked rows
  std::vector<int32_t> bitmask_;           // [masked rows, words] host
  std::vector<int32_t> row_ids_;  // [masked rows] logits rows
  void* d_bitmask_ = nullptr;     // device mirrors (CUDA), capacity d_rows_ rows
  void* d_row_ids_ = nullptr;
  int64_t d_rows_ = 0, d_words_ = 0;
};

// Advances seq.grammar_matcher (non-null) by the sampled `token`: kStop once
// the grammar has terminated (a stop token after a complete output), kError
// with seq.error set when the grammar refuses the token (cannot happen when
// the step's logits were masked), else kNone.
FinishReason advance_grammar(Sequence& seq, int32_t token);

}  // namespace nucleus
