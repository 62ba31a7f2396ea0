// Uploads a step's metadata to the device in one copy: the arrays are packed
// into pinned host memory and copied to one device buffer on the engine
// stream. The device buffer persists across steps (its addresses change only
// when a step needs more room).
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

  // Stream-async; the returned pointers stay valid until the next upload.
  DeviceStepInputs upload(const StepInputs& in);

 private:
  void* host_ = nullptr;
  void* dev_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace nucleus
