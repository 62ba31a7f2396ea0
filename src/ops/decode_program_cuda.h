// What the decode-program ops (ops/front_program_op.h, ops/moe_program_op.h)
// share on CUDA: job queues dealt once for each program width (1, 2, 4, 8
// rows), each step's stages checked once for its rows and buffers, and the
// launch of kernels/mono/mono_kernel.cuh.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "kernels/mono/mono_program.h"
#include "ops/op.h"

namespace nucleus::cuda_ops {

class DecodeProgramRunner {
 public:
  // The stages of a program of `width` rows (for the step's buffers, or
  // placeholders: the queues depend on the stages' shapes only).
  using MakeStages = std::function<std::vector<kernels::mono::Stage>(int32_t width)>;
  static constexpr int32_t kWidths[] = {1, 2, 4, 8};

  // Deals and uploads the queues of every width from make(width), and the
  // counters; once, before any CUDA-graph capture.
  void reserve(const MakeStages& make);
  // Launches the program of `rows` rows (1 ... 8) whose stages are
  // make(width) for this step's buffers, named by `buffers` (the check is
  // cached by rows and buffers: host work only after the first, so safe under
  // capture). A check that fails, stages that differ from the dealt queues,
  // or a launch error fail ctx naming `where`; returns whether it launched.
  bool launch(OpContext& ctx, int64_t rows, const std::vector<const void*>& buffers, const MakeStages& make,
              const std::string& where);

 private:
  static constexpr int kNumWidths = 4;
  static constexpr size_t kMaxChecked = 64;  // checked stage lists kept a width (graphs need a few)
  int32_t num_ctas_ = 0;
  bool lean_ = true;     // Program::lean (NUCLEUS_DECODE_PROGRAM_LEAN)
  bool release_ = true;  // Program::release_counters (NUCLEUS_DECODE_PROGRAM_RELEASE)
  Tensor counters_, queue_start_[kNumWidths], jobs_[kNumWidths];
  std::vector<int32_t> dealt_jobs_[kNumWidths];  // stage_jobs of each stage the queues were dealt for
  std::map<std::vector<const void*>, std::vector<kernels::mono::Stage>> checked_[kNumWidths];
};

}  // namespace nucleus::cuda_ops
