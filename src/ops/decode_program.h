// Which steps the decode-program ops (ops/front_program_op.h,
// ops/moe_program_op.h) run as programs: those of at most
// decode_program_max_rows() rows, that is the program widths 1 ... that
// (kernels/mono/mono_program.h builds widths 1, 2, 4 and 8); wider steps run
// the separate ops the program ops hold. docs/decode_program.md.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "ops/linear_weight.h"

namespace nucleus {

// NUCLEUS_DECODE_PROGRAM_MAX_ROWS: 1, 2, 4 or 8 (default 8, the widest
// program). Read when a graph is built; a malformed value reads as 8 here
// and is refused by decode_program_env_status() at model creation.
int64_t decode_program_max_rows();
// OK, or invalid_argument naming a NUCLEUS_DECODE_PROGRAM_MAX_ROWS value that
// is not 1, 2, 4 or 8.
Status decode_program_env_status();
// "widths 1, 2, 4 run as programs; wider steps (8 and up) the separate ops"
// for max_rows, for the start-up log.
std::string decode_program_widths_text(int64_t max_rows);

// OK when a program's GEMV stage can read linear weight w: bf16, or float8
// e4m3 with DeepSeek-V3's 128 x 128 block scales (kernels/mono/mono_program.h,
// WeightType::kFp8Block: in_features a multiple of 32); else unsupported
// naming the weight and why.
Status program_weight_supported(const LinearWeight& w);
// The block scales a program stage takes beside w's data: w's scale_inv
// ([ceil(out / 128), ceil(in / 128)] f32) for an FP8 weight, null for bf16.
inline const float* program_weight_scale(const LinearWeight& w) {
  return w.fp8() ? static_cast<const float*>(w.scale_inv.raw()) : nullptr;
}

}  // namespace nucleus
