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

}  // namespace nucleus
