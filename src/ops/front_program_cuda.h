// CUDA backend of the front_program op (ops/front_program_op.h): the front as
// one decode program (kernels/mono/mono_kernel.cuh) for steps of at most 8
// rows, the held ops for wider ones.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "kernels/mono/mono_program.h"
#include "ops/front_program_op.h"

namespace nucleus::cuda_ops {

// A step's buffers as the front's program reads and writes them (all null at
// reserve: the stages' shapes do not depend on them). residual [T, hidden]
// f32 (updated in place), delta [T, hidden] bf16 (null for the first layer),
// q [T, heads * (qk_nope + qk_rope)], kv_a [T, kv_lora + qk_rope], q_a [T,
// q_lora] (with a q LoRA) bf16; the layer's cache rows [num_slots, kv_lora +
// qk_rope] bf16.
struct FrontProgramBuffers {
  float* residual = nullptr;
  const uint16_t* delta = nullptr;
  uint16_t *q = nullptr, *kv_a = nullptr, *q_a = nullptr;
  uint16_t* q_full = nullptr;  // [T, heads, kv_lora + qk_rope] bf16 when the op absorbs
  float* partials = nullptr;   // the attention's partials when the op attends (its ProgramAttentionBuffer)
  const int32_t* block_tables = nullptr;  // the step's, and its row inputs, when the op attends
  const int32_t *token_seq = nullptr, *query_start = nullptr, *context_lens = nullptr;
  int32_t max_blocks = 0, block_size = 0;
  const int32_t* positions = nullptr;
  const int64_t* slot_mapping = nullptr;
  uint16_t* cache = nullptr;
  int64_t num_slots = 1;
};
// The buffers of a step: in = {residual[, delta]}, out = {residual, x_norm,
// q, kv_a[, q_a][, q_full]} (the op's buffers, ops/front_program_op.h), the step's
// positions and slot mapping and the layer's cache.
FrontProgramBuffers front_program_buffers(const FrontProgramOp& op, const OpContext& ctx, const TensorList& in,
                                          const TensorList& out);
// The front's stages (kernels/mono FrontChain) on those buffers, for a
// program of `width` rows; the op must have been reserved.
std::vector<kernels::mono::Stage> front_program_stages(const FrontProgramOp& op, const FrontProgramBuffers& b,
                                                       int32_t width);
// The buffers' addresses, for DecodeProgramRunner::launch's check cache.
std::vector<const void*> front_program_buffer_key(const FrontProgramBuffers& b);

Status front_program_supports(const FrontProgramOp& op);
// The program's residual scratch (8 rows), W_UK transposed (when the op
// absorbs), its per-width job queues and counters, made once before any
// capture.
Status front_program_reserve(FrontProgramOp& op, const StepLimits& limits, Device device);
void front_program(FrontProgramOp& op, OpContext& ctx, const TensorList& in, const TensorList& out);

}  // namespace nucleus::cuda_ops
