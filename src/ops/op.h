// Op: one operation of a step graph (a norm, a GEMM, attention, ...) bound to
// its weights and attributes. The graph feeds it buffers; the op runs the
// backend chosen for it when the graph was built (so replay never
// re-dispatches).
//
// Backend choice: each op family keeps an ordered list of backends, each with
// a supports() check that returns OK or the reason it refuses; the first
// supporter wins; when none does, the error lists every refusal.
// NUCLEUS_FORCE_KERNEL=<family>=<backend>[,...] forces a backend for A/B runs.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/step_inputs.h"

namespace nucleus {

// What a step touched, recorded on request (nucleus bench latency): the
// routed experts each MoE layer activated.
struct StepStats {
  int64_t moe_layers = 0;
  int64_t experts_activated = 0;  // unique experts summed over MoE layers
};

class FaultInjector;

// The largest step the engine runs: what an op's workspace and persistent
// state are sized for (StepResources::reserve). Counts, not bytes.
struct StepLimits {
  int64_t max_tokens = 0;          // rows of a step (RowSpace::kTokens)
  int64_t max_seqs = 0;            // sequences of a step
  int64_t max_logits = 0;          // logit rows of a step (RowSpace::kLogits)
  int64_t max_blocks_per_seq = 0;  // block-table width
  int64_t block_size = 0;          // KV-cache rows per block; 0: unknown
};

// Device memory an op may use during its run: one arena shared by every op
// of the step (graph/step_resources.h), so its contents do not survive from
// one op to the next. Allocated once before any CUDA-graph capture (its
// address stays fixed). At least the largest Op::workspace_bytes of the
// graph; null and 0 when no op declares any.
struct OpWorkspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// Everything an op may read besides its buffers, and where it reports an
// error.
//
// Errors: an op's run cannot return a value (its backends are plain function
// pointers), so a failure that input or resources can cause inside a step (a
// scratch allocation, a communicator, a kernel plan refusing a shape) is
// reported with fail() and the op returns at once; the executor
// (run_nodes) stops the step after that op and returns the error up to the
// engine, which fails the step's requests and goes on. A broken invariant (a
// bug) still stops the process with NUCLEUS_CHECK.
struct OpContext {
  Device device = Device::kCpu;
  void* stream = nullptr;  // cudaStream_t on CUDA
  const StepInputs* inputs = nullptr;     // host metadata
  const DeviceStepInputs* dev = nullptr;  // device copies (CUDA only)
  KvCache* kv_cache = nullptr;
  StepStats* stats = nullptr;  // non-null: ops record what the step touched (benchmarks; syncs)
  FaultInjector* faults = nullptr;  // NUCLEUS_FAULT_INJECT (graph/fault_injection.h); null: none
  OpWorkspace workspace;  // the step's arena (StepResources::begin_step)
  // The first error an op reported since the executor last took it.
  Status error;

  // Records `s` (not OK) as the step's error unless one is recorded already;
  // the caller returns right after. Safe under CUDA graph capture (the
  // capture then ends with the error).
  void fail(Status s) {
    if (error.ok()) error = std::move(s);
  }
  bool failed() const { return !error.ok(); }
};

// A device tensor of `shape` and `dtype` for an op's scratch or workspace, or
// kResourceExhausted naming `what` and the bytes when the allocation fails
// (instead of stopping the process as Tensor::empty does). On the CPU, host
// memory. Not under CUDA graph capture (allocating there is a bug).
StatusOr<Tensor> try_empty(std::vector<int64_t> shape, DType dtype, Device device, const std::string& what);

// Work shared by the ops of one family and backend that depends only on the
// step (e.g. a host-side attention schedule): made once per step, before the
// layers run (StepResources::begin_step), and read by each op's run. The ops
// that share one return the same object from Op::step_plan() (the graph
// shares them at StepGraph::select_backends by Op::step_plan_key()).
class StepPlan {
 public:
  virtual ~StepPlan() = default;
  // Plans the step `ctx` describes (ctx.inputs, ctx.dev, ctx.workspace set).
  // Errors: the step cannot be planned (it then fails, the engine goes on).
  virtual Status plan(OpContext& ctx) = 0;
  // Whether plan() only launches device work from the step's device
  // metadata, so a CUDA graph may capture it; a host plan (the default) may
  // not run under capture.
  virtual bool capturable() const { return false; }
};

class Op {
 public:
  virtual ~Op() = default;
  // Op family, e.g. "linear", "rmsnorm", "mla_attention".
  virtual const char* kind() const = 0;
  // Attributes for graph dumps, e.g. "n=576 k=256 accumulate=0".
  virtual std::string attrs() const { return {}; }
  // Chooses this op's backend for `device` (called once, at graph build).
  virtual Status select_backend(Device device) = 0;
  // The chosen backend's name.
  const std::string& backend() const { return backend_; }
  // Runs on `in` / `out` (the node's buffers, rows = the step's rows).
  virtual void run(OpContext& ctx, const std::vector<Tensor>& in, const std::vector<Tensor>& out) = 0;
  // Whether input `index` may be an f32 buffer where the model declared a
  // bf16 one (the f32 output of a split-K GEMM, graph/passes/splitk_pass.h),
  // on every backend; and, when that input is also the op's in-place output,
  // whether the op can then read it from the f32 buffer and write the
  // declared one (out of place). False unless the op says so.
  virtual bool accepts_f32_input(size_t index) const { return false; }

  // Device bytes of ctx.workspace the chosen backend needs during a run of a
  // step within `limits` (0: none). Called after select_backend.
  virtual size_t workspace_bytes(const StepLimits& limits) const { return 0; }
  // Allocates the state the chosen backend keeps across runs (e.g. counters a
  // captured graph keeps), for steps within `limits`, on `device`; called
  // once per reservation, before any capture. Errors: an allocation failing.
  virtual Status reserve(const StepLimits& limits, Device device) { return ok_status(); }
  // The chosen backend's per-step plan, or null when it plans nothing.
  virtual StepPlan* step_plan() const { return step_plan_.get(); }
  // What decides whether two ops of this family and backend can share a plan
  // (their attributes that the plan reads), e.g. "heads=16 mode=auto".
  virtual std::string step_plan_key() const { return {}; }
  // Replaces this op's plan with `plan` (a plan of another op of the same
  // family, backend and step_plan_key()).
  void share_step_plan(std::shared_ptr<StepPlan> plan) { step_plan_ = std::move(plan); }
  const std::shared_ptr<StepPlan>& shared_step_plan() const { return step_plan_; }

  // Whether the op's graph is captured in CUDA graphs (set by the model
  // before select_backend): backends that cannot run under capture refuse.
  void set_captured(bool captured) { captured_ = captured; }
  bool captured() const { return captured_; }

 protected:
  std::string backend_;
  std::shared_ptr<StepPlan> step_plan_;
  bool captured_ = false;
};

using TensorList = std::vector<Tensor>;

// An entry of an op family's ordered backend list; OpT is the op class
// (its attributes are what supports() inspects).
template <typename OpT>
struct Backend {
  const char* name;
  Device device;
  Status (*supports)(const OpT& op);  // OK, or why not; null: always
  void (*run)(OpT& op, OpContext& ctx, const TensorList& in, const TensorList& out);
  // Optional (null: none). Bytes of ctx.workspace a run needs (Op::workspace_bytes).
  size_t (*workspace)(const OpT& op, const StepLimits& limits) = nullptr;
  // State kept across runs, allocated once (Op::reserve).
  Status (*reserve)(OpT& op, const StepLimits& limits, Device device) = nullptr;
  // A new per-step plan for the op (Op::step_plan); ops of the same
  // step_plan_key() then share one.
  std::shared_ptr<StepPlan> (*make_plan)(const OpT& op) = nullptr;
};

// The first backend in `list` for `device` whose supports(spec) is OK, as an
// index; or kUnsupported listing each backend's refusal. Honours
// NUCLEUS_FORCE_KERNEL for `family`.
template <typename OpT>
StatusOr<size_t> choose_backend(const char* family, const std::vector<Backend<OpT>>& list, Device device,
                                const OpT& op);

// The backend NUCLEUS_FORCE_KERNEL names for `family`, or "" (parsed once).
std::string forced_backend(const char* family);
// The error for a malformed NUCLEUS_FORCE_KERNEL (an item that is not
// family=backend, or a family no op dispatches), or "".
std::string forced_backend_error();
// Whether `family` is an op family NUCLEUS_FORCE_KERNEL can name.
bool is_kernel_family(const std::string& family);

template <typename OpT>
StatusOr<size_t> choose_backend(const char* family, const std::vector<Backend<OpT>>& list, Device device,
                                const OpT& op) {
  if (std::string err = forced_backend_error(); !err.empty()) return invalid_argument(err);
  std::string forced = forced_backend(family);
  // A forced name applies to the device that has a backend of that name.
  bool forced_here = false, forced_anywhere = false;
  std::string known;
  for (const auto& b : list) {
    forced_here |= b.device == device && forced == b.name;
    forced_anywhere |= forced == b.name;
    known += std::string(known.empty() ? "" : ", ") + b.name;
  }
  if (!forced.empty() && !forced_anywhere)
    return invalid_argument("NUCLEUS_FORCE_KERNEL names backend '" + forced + "' for " + family +
                            ", which has none of that name (known: " + known + ")");
  if (!forced_here) forced.clear();
  std::string reasons;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& b = list[i];
    if (b.device != device) continue;
    if (!forced.empty() && forced != b.name) {
      reasons += std::string("; ") + b.name + ": not the forced backend";
      continue;
    }
    Status s = b.supports ? b.supports(op) : ok_status();
    if (s.ok()) return i;
    reasons += std::string("; ") + b.name + ": " + s.message();
  }
  return unsupported(std::string("no ") + device_name(device) + " backend for " + family +
                     (forced.empty() ? "" : " (NUCLEUS_FORCE_KERNEL=" + forced + ")") +
                     (reasons.empty() ? "" : ": " + reasons.substr(2)));
}

}  // namespace nucleus

namespace nucleus {

// Base for ops whose backends are a static ordered list, Derived::backends().
template <typename Derived>
class OpWithBackends : public Op {
 public:
  Status select_backend(Device device) override {
    const auto& list = Derived::backends();
    auto i = choose_backend(kind(), list, device, static_cast<const Derived&>(*this));
    if (!i.ok()) return i.status();
    adopt(list[*i]);
    return ok_status();
  }
  // Uses `b` (an entry of Derived::backends()) without the dispatch: kernel
  // tests and benchmarks that run each backend. Errors: b refuses the op.
  Status use_backend(const Backend<Derived>& b) {
    if (b.supports) NUCLEUS_RETURN_IF_ERROR(b.supports(static_cast<const Derived&>(*this)));
    adopt(b);
    return ok_status();
  }
  size_t workspace_bytes(const StepLimits& limits) const override {
    return chosen_ && chosen_->workspace ? chosen_->workspace(static_cast<const Derived&>(*this), limits) : 0;
  }
  Status reserve(const StepLimits& limits, Device device) override {
    return chosen_ && chosen_->reserve ? chosen_->reserve(static_cast<Derived&>(*this), limits, device) : ok_status();
  }
  void run(OpContext& ctx, const TensorList& in, const TensorList& out) override {
    NUCLEUS_CHECK(chosen_ != nullptr, "op {} run before select_backend", kind());
    chosen_->run(static_cast<Derived&>(*this), ctx, in, out);
  }

 private:
  void adopt(const Backend<Derived>& b) {
    chosen_ = &b;
    backend_ = b.name;
    step_plan_ = b.make_plan ? b.make_plan(static_cast<const Derived&>(*this)) : nullptr;
  }
  const Backend<Derived>* chosen_ = nullptr;
};

// Base for ops that hold other ops and run them for the steps their own
// backend does not serve (the decode-program ops): backend selection (for the
// same device and capture), workspace (the largest) and reserve reach the held
// ops too. Derived::held() lists them; null entries are skipped.
template <typename Derived>
class OpHoldingOps : public OpWithBackends<Derived> {
 public:
  Status select_backend(Device device) override {
    NUCLEUS_RETURN_IF_ERROR(OpWithBackends<Derived>::select_backend(device));
    for (Op* op : held()) {
      if (!op) continue;
      op->set_captured(this->captured());
      NUCLEUS_RETURN_IF_ERROR(op->select_backend(device).with_context(std::string(this->kind()) + "'s " + op->kind()));
    }
    return ok_status();
  }
  size_t workspace_bytes(const StepLimits& limits) const override {
    size_t b = OpWithBackends<Derived>::workspace_bytes(limits);
    for (const Op* op : held())
      if (op) b = std::max(b, op->workspace_bytes(limits));
    return b;
  }
  Status reserve(const StepLimits& limits, Device device) override {
    for (Op* op : held())
      if (op) NUCLEUS_RETURN_IF_ERROR(op->reserve(limits, device));
    return OpWithBackends<Derived>::reserve(limits, device);
  }

 protected:
  virtual std::vector<Op*> held() const = 0;
};

}  // namespace nucleus
