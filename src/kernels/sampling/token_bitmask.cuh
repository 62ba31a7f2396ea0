// Grammar token masks on the device (structured output,
// runtime/structured_output.h): for each masked row,
//   logits[rows[m], t] = -inf  for every t in [0, vocab) with bit (t % 32) of
//                              bitmask[m, t / 32] clear.
// Same result as the CPU's apply_token_bitmask row by row (bit-exact: only
// -inf is written). One thread per logit, so reads of the mask word and
// writes of the logits are coalesced; a 129k vocabulary row is ~0.5 MB of
// traffic at most.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace nucleus::kernels {

// Applies `num_masked` row masks.
//   logits:  [num_logit_rows, vocab] f32 (device), row stride vocab; rows
//            not named in `rows` are untouched.
//   bitmask: [num_masked, ceil(vocab / 32)] int32 (device), row-major.
//   rows:    [num_masked] int32 (device): the logits row of each mask, each
//            in [0, num_logit_rows) (the caller's invariant).
// Errors: cudaErrorInvalidValue for vocab outside [1, 2^31) or a negative
// num_masked (0: nothing to do). Stream-async, graph-safe (no allocation, no sync).
cudaError_t launch_apply_token_bitmask(float* logits, int64_t vocab, const int32_t* bitmask, const int32_t* rows,
                                       int64_t num_masked, cudaStream_t stream);

}  // namespace nucleus::kernels
