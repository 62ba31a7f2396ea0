// Per-op device time of eager steps (NUCLEUS_PROFILE_OPS): each node is
// bracketed by CUDA events (CPU: a wall clock) and the totals are printed at
// exit, per step phase (decode / prefill, set by the model):
//   NUCLEUS_PROFILE_OPS=1     per op family/backend ("decode linear/cuda_splitk");
//   NUCLEUS_PROFILE_OPS=node  per graph node with the layer index folded
//                             ("decode layers.*.self_attn.q_a_proj [linear/cuda_splitk]",
//                             us/call = per layer), plus the time per layer
//                             (all layers.* nodes / layers run).
// Profiling serialises nothing but adds two event records per node; graph
// replays are not profiled (run with --enforce-eager to profile decode).
// Under tensor parallelism every rank's nodes are counted (calls and times
// add up; the phase is per rank thread, and a layer run is one rank's).
#pragma once

#include <string>

#include "core/status.h"

namespace nucleus {

bool op_profiling_enabled();
// OK when NUCLEUS_PROFILE_OPS is unset, a flag value or "node"; else
// invalid_argument naming it (it read as off before). Checked at model creation.
Status profile_ops_env_status();
// NUCLEUS_PROFILE_OPS=node.
bool op_profiling_per_node();
// The phase later labels are filed under (e.g. "decode", "prefill").
void op_profile_set_phase(const char* phase);
// The label of a node for the current mode (without the phase).
std::string op_profile_label(const std::string& node_name, const std::string& kind, const std::string& backend);
// Marks the start / end of node `label` (e.g. "linear/cublaslt").
void op_profile_begin();
void op_profile_end(const std::string& label);
// Prints the table (also done at exit when enabled).
void op_profile_report();

}  // namespace nucleus
