// Uploads a step's metadata to the device: each array is packed into pinned
// host memory and copied to its region of one device buffer on the engine
// stream. Regions sit at offsets fixed by the reserved capacity, so the
// device addresses are the same every step (CUDA graphs bake them in); a
// step larger than the capacity grows the buffer and bumps generation().
// A packed upload (the decode-graph route) instead places the regions by
// the step's own lengths and copies them in one transfer (upload).
//
// The pinned staging memory is double-buffered, each half guarded by an
// event recorded after its copies: a step that returns nothing to the host
// (a prefill chunk that samples no token) does not synchronise, so the host
// may pack step n+1 while the copies of step n are still queued; it must not
// overwrite the memory those copies read from. The host waits only when the
// device is two whole steps behind.
#pragma once

#include <cstddef>

#include "ops/step_inputs.h"

namespace nucleus {

class DeviceInputUploader {
 public:
  DeviceInputUploader() = default;
  ~DeviceInputUploader();
  DeviceInputUploader(const DeviceInputUploader&) = delete;
  DeviceInputUploader& operator=(const DeviceInputUploader&) = delete;

  struct Capacity {
    int64_t tokens = 0;
    int64_t seqs = 0;
    int64_t block_table_entries = 0;  // num_seqs * max_blocks_per_seq
    int64_t logits = 0;
  };
  // Allocates the regions for steps up to `cap`.
  void reserve(const Capacity& cap);
  // Stream-async; the returned pointers stay valid until the next upload.
  // The buffer first grows to hold `in` (as reserve) wherever its regions go.
  // Unpacked (the default): each region at its capacity offset, one copy a
  // non-empty region (up to nine). Packed (NUCLEUS_PACKED_UPLOAD; the
  // decode-graph route, at capture and at replay): the same regions in the
  // same order, each at a 256-byte aligned offset that depends only on the
  // lengths of `in`'s arrays, copied in one transfer; steps of equal lengths
  // (a decode step padded to a captured size) in one generation() get equal
  // addresses, which a captured graph keeps. A packed step never needs more than the capacity
  // layout (a NUCLEUS_CHECK). Errors: a failed copy throws OpCudaError (the
  // step's error, ops/op_cuda_check.h); a failed reallocation stops the process.
  DeviceStepInputs upload(const StepInputs& in, bool packed = false);
  // Changes whenever the buffer is reallocated (device addresses changed).
  int64_t generation() const { return generation_; }

 private:
  void layout();
  Capacity cap_;
  size_t offsets_[10] = {};
  void* host_[2] = {nullptr, nullptr};  // pinned staging halves, used in turn
  void* copied_[2] = {nullptr, nullptr};  // cudaEvent_t: the half's last copies have run
  int next_ = 0;
  void* dev_ = nullptr;
  size_t bytes_ = 0;
  int64_t generation_ = 0;
};

}  // namespace nucleus
