#include "graph/cuda_graph.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "ops/op_cuda_check.h"

namespace nucleus {

CudaGraph::~CudaGraph() { reset(); }

CudaGraph::CudaGraph(CudaGraph&& o) noexcept : graph_(o.graph_), exec_(o.exec_) { o.graph_ = o.exec_ = nullptr; }

CudaGraph& CudaGraph::operator=(CudaGraph&& o) noexcept {
  if (this != &o) {
    reset();
    graph_ = o.graph_;
    exec_ = o.exec_;
    o.graph_ = o.exec_ = nullptr;
  }
  return *this;
}

void CudaGraph::reset() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  exec_ = graph_ = nullptr;
}

StatusOr<CudaGraph> CudaGraph::capture(const std::function<Status()>& work) {
  cudaStream_t stream = cuda::context().stream;
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
  NUCLEUS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status worked = work();
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamEndCapture(stream, &graph);
  if (!worked.ok()) {  // end the capture either way, so the stream leaves capture mode
    if (err == cudaSuccess && graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return worked.with_context("during CUDA graph capture");
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    return internal_error(std::string("CUDA graph capture failed: ") + cudaGetErrorString(err));
  }
  cudaGraphExec_t exec = nullptr;
  err = cudaGraphInstantiate(&exec, graph, 0);
  if (err != cudaSuccess) {
    cudaGraphDestroy(graph);
    cudaGetLastError();
    return internal_error(std::string("CUDA graph instantiation failed: ") + cudaGetErrorString(err));
  }
  CudaGraph g;
  g.graph_ = graph;
  g.exec_ = exec;
  return g;
}

void CudaGraph::replay() const {
  NUCLEUS_OP_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), cuda::context().stream));
}

}  // namespace nucleus
#else
namespace nucleus {
CudaGraph::~CudaGraph() = default;
CudaGraph::CudaGraph(CudaGraph&&) noexcept = default;
CudaGraph& CudaGraph::operator=(CudaGraph&&) noexcept = default;
void CudaGraph::reset() {}
StatusOr<CudaGraph> CudaGraph::capture(const std::function<Status()>&) {
  return unsupported("CUDA graphs need a CUDA build");
}
void CudaGraph::replay() const {}
}  // namespace nucleus
#endif
