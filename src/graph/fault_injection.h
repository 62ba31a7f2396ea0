// Test-only fault injection: NUCLEUS_FAULT_INJECT=<op kind>:<n>[:fatal]
// makes the n-th run (1-based, counted per model from its creation) of an op
// of that kind report an error instead of running, once. The graph executor
// (run_nodes) applies it, so it works for every op and backend, the CPU's
// included. `fatal` also marks the model unusable afterwards, as a sticky
// CUDA error or an aborted communicator would (DeepseekModel::health), so
// tests can drive the engine's unrecoverable path. Only steps run through
// the executor count: graph replays and CUDA graph capture do not (use
// --enforce-eager on CUDA). docs/flags.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/status.h"

namespace nucleus {

struct FaultPlan {
  std::string kind;  // an op kind, e.g. "embedding", "moe_experts"
  int64_t nth = 0;   // >= 1
  bool fatal = false;
};

// Parses a NUCLEUS_FAULT_INJECT value ("" : no fault). Errors
// (kInvalidArgument): not <kind>:<n>[:fatal] with n >= 1.
StatusOr<std::optional<FaultPlan>> parse_fault_plan(const std::string& value);

// One model's injector; not thread-safe (a model runs one step at a time).
class FaultInjector {
 public:
  explicit FaultInjector(FaultPlan plan) : plan_(std::move(plan)) {}

  // Called by the executor before an op of `kind` runs at node `node`:
  // OK (run it), or the injected error (kInternal, naming the op, the node
  // and the switch) on the planned call.
  Status before_run(const char* kind, const std::string& node);
  // Whether a fatal fault fired (the model is then unusable).
  bool fatal_fired() const { return fatal_fired_; }
  const FaultPlan& plan() const { return plan_; }

 private:
  FaultPlan plan_;
  int64_t calls_ = 0;
  bool fatal_fired_ = false;
};

}  // namespace nucleus
