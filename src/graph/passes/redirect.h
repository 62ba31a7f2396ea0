// Moving a node's output to another buffer, and its readers with it: the
// rewiring both graph passes (splitk_pass.h, prezero_pass.h) do.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "graph/step_graph.h"

namespace nucleus {

// The nodes after `node` that read the value `node` writes to buffer
// `old_id`, as (node index, input index) pairs: every later reader up to the
// buffer's next writer. A node that only writes the buffer starts a new value
// (not included); a node that reads and writes it (in place) is the last one
// included.
std::vector<std::pair<size_t, size_t>> readers_of_output(const StepGraph& g, size_t node, int old_id);

// Makes `node` write `new_id` instead of `old_id`, and every reader
// readers_of_output() lists read `new_id` at that input. An in-place reader
// keeps writing `old_id`: it becomes out of place, reading the new buffer and
// writing the declared one (the op must accept that: Op::accepts_f32_input).
// Returns the readers it rewired.
std::vector<std::pair<size_t, size_t>> redirect_output(StepGraph& g, size_t node, int old_id, int new_id);

}  // namespace nucleus
