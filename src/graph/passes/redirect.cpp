#include "graph/passes/redirect.h"

#include <algorithm>

namespace nucleus {

std::vector<std::pair<size_t, size_t>> readers_of_output(const StepGraph& g, size_t node, int old_id) {
  std::vector<std::pair<size_t, size_t>> readers;
  for (size_t i = node + 1; i < g.nodes().size(); ++i) {
    const Node& n = g.nodes()[i];
    const bool writes = std::find(n.outputs.begin(), n.outputs.end(), old_id) != n.outputs.end();
    for (size_t k = 0; k < n.inputs.size(); ++k)
      if (n.inputs[k] == old_id) readers.emplace_back(i, k);
    if (writes) return readers;  // a new value (or, in place, the last use of this one)
  }
  return readers;
}

std::vector<std::pair<size_t, size_t>> redirect_output(StepGraph& g, size_t node, int old_id, int new_id) {
  auto readers = readers_of_output(g, node, old_id);
  for (int& id : g.nodes()[node].outputs)
    if (id == old_id) id = new_id;
  for (const auto& [i, k] : readers) g.nodes()[i].inputs[k] = new_id;
  return readers;
}

}  // namespace nucleus
