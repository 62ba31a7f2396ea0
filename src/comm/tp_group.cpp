#include "comm/tp_group.h"

#include "comm/inprocess_communicator.h"
#include "comm/nccl_communicator.h"
#include "core/check.h"
#include "core/device.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#endif

namespace nucleus {

StatusOr<std::unique_ptr<TpGroup>> TpGroup::create(int world_size, Device device) {
  if (world_size < 1 || world_size > kMaxRanks)
    return invalid_argument("--tensor-parallel-size must be in [1, " + std::to_string(kMaxRanks) + "], got " +
                            std::to_string(world_size));
  std::unique_ptr<TpGroup> g(new TpGroup());
  g->device_ = device;
  if (device == Device::kCpu) {
    NUCLEUS_ASSIGN_OR_RETURN(g->comms_, make_inprocess_communicators(world_size));
  } else {
#ifdef NUCLEUS_HAVE_CUDA
    const int visible = cuda::device_count();
    if (visible < world_size)
      return invalid_argument("--tensor-parallel-size " + std::to_string(world_size) + " needs " +
                              std::to_string(world_size) + " GPUs; " + std::to_string(visible) +
                              " visible (CUDA_VISIBLE_DEVICES)");
    std::vector<int> devices;
    for (int r = 0; r < world_size; ++r) devices.push_back(r);
    NUCLEUS_ASSIGN_OR_RETURN(g->comms_, make_nccl_communicators(devices));
#else
    return unsupported("tensor parallelism on CUDA needs a CUDA build");
#endif
  }
  g->results_.resize(world_size);
  for (int r = 0; r < world_size; ++r) g->threads_.emplace_back([p = g.get(), r] { p->loop(r); });
  if (device == Device::kCuda) {
#ifdef NUCLEUS_HAVE_CUDA
    NUCLEUS_RETURN_IF_ERROR(g->run([](int rank) { return cuda::bind_thread_to_device(rank); }));
#endif
  }
  return g;
}

TpGroup::~TpGroup() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  peer_buffers_.clear();
  comms_.clear();
}

void TpGroup::loop(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<Status(int)>* job = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    Status s = (*job)(rank);
    if (!s.ok())  // wake the ranks that wait for this one in a collective
      for (auto& c : comms_) c->abort("rank " + std::to_string(rank) + " failed: " + s.message());
    {
      std::lock_guard<std::mutex> lock(mu_);
      results_[rank] = std::move(s);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
}

Status TpGroup::run(const std::function<Status(int rank)>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  NUCLEUS_CHECK(pending_ == 0, "TpGroup::run is not reentrant");
  job_ = &fn;
  pending_ = world_size();
  for (auto& r : results_) r = ok_status();
  ++generation_;
  cv_.notify_all();
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  // The cause first: a rank's own error before the aborts it led to.
  for (bool aborts : {false, true})
    for (int r = 0; r < world_size(); ++r)
      if (!results_[r].ok() && (aborts || results_[r].code() != StatusCode::kAborted))
        return results_[r].with_context("rank " + std::to_string(r));
  return ok_status();
}

StatusOr<std::vector<void*>> TpGroup::make_peer_buffers(size_t bytes) {
  if (device_ != Device::kCuda) return unsupported("peer buffers need a CUDA group");
#ifdef NUCLEUS_HAVE_CUDA
  const int n = world_size();
  std::vector<Tensor> buffers(n);
  NUCLEUS_RETURN_IF_ERROR(run([&](int rank) -> Status {
    for (int peer = 0; peer < n; ++peer) {
      if (peer == rank) continue;
      int can = 0;
      NUCLEUS_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, rank, peer));
      if (!can)
        return unsupported("GPU " + std::to_string(rank) + " cannot access GPU " + std::to_string(peer) +
                           "'s memory (no peer access: no NVLink/PCIe P2P between them)");
      const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clear: NCCL may have enabled it
      } else {
        NUCLEUS_CUDA_CHECK(e);
      }
    }
    buffers[rank] = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kU8, Device::kCuda);
    zero_device(buffers[rank]);
    return ok_status();
  }));
  std::vector<void*> ptrs;
  for (auto& b : buffers) {
    ptrs.push_back(b.raw());
    peer_buffers_.push_back(std::move(b));
  }
  return ptrs;
#else
  return unsupported("peer buffers need a CUDA build");
#endif
}

}  // namespace nucleus
