// Per-op device time of eager steps (NUCLEUS_PROFILE_OPS=1): each node is
// bracketed by CUDA events (CPU: a wall clock) and the totals per op
// family/backend are printed at exit. Profiling serialises nothing but adds
// two event records per node; graph replays are not profiled. Under tensor
// parallelism every rank's nodes are counted (calls and times add up).
#pragma once

#include <string>

namespace nucleus {

bool op_profiling_enabled();
// Marks the start / end of node `label` (e.g. "linear/cublaslt").
void op_profile_begin();
void op_profile_end(const std::string& label);
// Prints the table (also done at exit when enabled).
void op_profile_report();

}  // namespace nucleus
