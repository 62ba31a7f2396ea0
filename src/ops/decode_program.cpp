#include "ops/decode_program.h"

#include "core/knobs.h"

namespace nucleus {

namespace {

// 0: malformed.
int64_t parse_max_rows() {
  const auto v = env_string(Knob::kDecodeProgramMaxRows);
  if (!v || v->empty()) return 8;
  for (int64_t w : {1, 2, 4, 8})
    if (*v == std::to_string(w)) return w;
  return 0;
}

}  // namespace

int64_t decode_program_max_rows() {
  const int64_t w = parse_max_rows();
  return w > 0 ? w : 8;
}

Status decode_program_env_status() {
  if (parse_max_rows() == 0)
    return invalid_argument("NUCLEUS_DECODE_PROGRAM_MAX_ROWS='" + *env_string(Knob::kDecodeProgramMaxRows) +
                            "' is not 1, 2, 4 or 8");
  return ok_status();
}

std::string decode_program_widths_text(int64_t max_rows) {
  std::string s = "widths";
  for (int64_t w = 1; w <= max_rows; w *= 2) s += (w > 1 ? ", " : " ") + std::to_string(w);
  return s + " run as programs; steps of more than " + std::to_string(max_rows) +
         " rows run the separate ops (NUCLEUS_DECODE_PROGRAM_MAX_ROWS)";
}

Status program_weight_supported(const LinearWeight& w) {
  if (w.weight.dtype() == DType::kBF16) return ok_status();
  if (!w.fp8()) return unsupported(w.name + " is neither bf16 nor FP8 e4m3 (programs read those)");
  if (w.block_n != 128 || w.block_k != 128 || !w.scale_inv.defined() || w.scale_inv.dtype() != DType::kF32)
    return unsupported(w.name + ": programs read FP8 weights with 128 x 128 block scales (f32)");
  const int64_t scales = (w.out_features + 127) / 128 * ((w.in_features + 127) / 128);
  if (w.scale_inv.numel() != scales)
    return unsupported(w.name + ": " + std::to_string(w.scale_inv.numel()) + " block scales, not the [ceil(out / 128), " +
                       "ceil(in / 128)] = " + std::to_string(scales) + " a program reads");
  if (w.in_features % 32 != 0)
    return unsupported(w.name + ": in_features " + std::to_string(w.in_features) +
                       " is not a multiple of 32 (a program's FP8 step)");
  return ok_status();
}

}  // namespace nucleus
