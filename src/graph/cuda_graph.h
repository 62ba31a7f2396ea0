// CudaGraph: a captured sequence of work on the engine stream, replayed with
// one launch. Inputs of captured work must live in persistent buffers that
// every replay rewrites (the step buffers, the device step inputs, the KV
// cache): nothing a replayed kernel reads may be allocated per step.
#pragma once

#include <functional>
#include <memory>

#include "core/status.h"

namespace nucleus {

class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(CudaGraph&& o) noexcept;
  CudaGraph& operator=(CudaGraph&& o) noexcept;
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Captures what `work` enqueues on the engine stream (work must not
  // synchronise or allocate) and instantiates it. When `work` returns an
  // error, the capture is ended and discarded (the stream is usable again)
  // and that error is returned.
  static StatusOr<CudaGraph> capture(const std::function<Status()>& work);
  // Enqueues a replay on the engine stream.
  void replay() const;
  bool valid() const { return exec_ != nullptr; }

 private:
  void reset();
  void* graph_ = nullptr;  // cudaGraph_t
  void* exec_ = nullptr;   // cudaGraphExec_t
};

}  // namespace nucleus
