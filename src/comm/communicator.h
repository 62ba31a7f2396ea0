// Collective communication between the ranks of a tensor-parallel group: the
// interface the model's ops call, with two backends --
//   in-process (inprocess_communicator.h): the ranks are threads of one
//     process and share host memory; the CPU engine and its tests use it;
//   NCCL (nccl_communicator.h): the ranks are GPUs of one host, driven by one
//     thread each; libnccl.so.2 is loaded at run time.
// Semantics follow NCCL's (ncclAllReduce, ncclAllGather, ncclBroadcast).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"

namespace nucleus {

// One rank's endpoint of a group of world_size() ranks. Every rank must make
// the same calls, with the same counts and dtypes, in the same order (as with
// NCCL); a call from one rank waits for the others'. Buffers live on device():
// host memory for the in-process backend, device memory of the rank's GPU for
// NCCL. In-process calls are synchronous (the data is in place on return);
// NCCL calls are enqueued on `stream` (a cudaStream_t: stream-async and safe
// under CUDA-graph capture). Errors: a dtype the call does not take, a group
// that was aborted (a rank failed), a failure of the NCCL library.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Device device() const = 0;
  // "inprocess" or "nccl".
  virtual const char* backend() const = 0;

  // recv[i] = sum over ranks r of send_r[i], for i < count. dtype f32 or bf16;
  // recv may equal send (in place). Every rank receives the same bits
  // (in-process: summed in f32 in rank order 0, 1, ..., then rounded to the
  // dtype; NCCL: its own order).
  virtual Status all_reduce_sum(const void* send, void* recv, int64_t count, DType dtype, void* stream) = 0;
  // recv[r * count + i] = send_r[i]: recv holds world_size() * count elements
  // (rank-major). Any dtype.
  virtual Status all_gather(const void* send, void* recv, int64_t count, DType dtype, void* stream) = 0;
  // buf[i] = buf_root[i] on every rank. Any dtype.
  virtual Status broadcast(void* buf, int64_t count, DType dtype, int root, void* stream) = 0;
  // Makes this rank's pending and later collectives fail instead of waiting
  // for peers (for a rank whose peer failed mid-step; the group is then
  // unusable). In-process: wakes every rank waiting in a collective.
  virtual void abort(const std::string& why) = 0;
};

}  // namespace nucleus
