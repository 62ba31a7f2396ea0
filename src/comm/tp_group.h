// A tensor-parallel group inside one process: one persistent thread per rank
// (bound to GPU r on CUDA), one communicator per rank, and on CUDA the
// peer-mapped buffers the fused all-reduce kernel signals through.
//
// Why threads of one process rather than one process per GPU: docs/tp.md.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace nucleus {

class TpGroup {
 public:
  // Most ranks a group has (the GPUs of one host).
  static constexpr int kMaxRanks = 8;

  // `world_size` ranks on `device`: in-process communicators on the CPU,
  // NCCL over GPUs 0 .. world_size - 1 on CUDA (rank r's thread bound to GPU r).
  // Errors: world_size outside [1, kMaxRanks], fewer visible GPUs than ranks,
  // NCCL not found or failing to initialise.
  static StatusOr<std::unique_ptr<TpGroup>> create(int world_size, Device device);
  ~TpGroup();
  TpGroup(const TpGroup&) = delete;
  TpGroup& operator=(const TpGroup&) = delete;

  int world_size() const { return static_cast<int>(comms_.size()); }
  Device device() const { return device_; }
  Communicator& comm(int rank) { return *comms_.at(rank); }

  // Runs fn(rank) on every rank's thread at once and waits for all of them.
  // Returns OK or the error of the lowest failing rank, prefixed "rank r: "
  // (an error of its own before the abort errors it caused in other ranks).
  // When a rank fails, every communicator of the group is aborted, so ranks
  // waiting in a collective return instead of hanging; the group (and the
  // model on it) is unusable afterwards. Not reentrant: one run at a time.
  Status run(const std::function<Status(int rank)>& fn);

  // CUDA: `bytes` of zeroed device memory on every rank's GPU, peer access
  // enabled between every pair of the group's GPUs; returns the buffers by
  // rank (owned by the group). Errors: a pair of GPUs without peer access
  // (named), a CPU group.
  StatusOr<std::vector<void*>> make_peer_buffers(size_t bytes);

 private:
  TpGroup() = default;
  void loop(int rank);

  Device device_ = Device::kCpu;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<Tensor> peer_buffers_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<Status(int)>* job_ = nullptr;
  std::vector<Status> results_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace nucleus
