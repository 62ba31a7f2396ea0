#include "ops/prezero.h"

#include "core/tensor.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "core/cuda/context.h"
#endif

namespace nucleus {

int prezero_sm_count() {
#ifdef NUCLEUS_HAVE_CUDA
  if (device_allocator_registered(Device::kCuda)) return cuda::context().num_sms;
#endif
  return 132;
}

bool is_prezero_free(int64_t m, int64_t n) {
  const int64_t sms = prezero_sm_count();
  if (m <= 0 || m >= sms) return false;
  return m * n * 4 <= (sms - m) * kPrezeroIdleBytesPerSm;
}

PrezeroFill prezero_fill(int64_t m, int64_t n_total, int64_t n_base) {
  if (is_prezero_free(m, n_total)) return PrezeroFill::kAll;
  if (n_base > 0 && is_prezero_free(m, n_base)) return PrezeroFill::kBase;
  return PrezeroFill::kNone;
}

const char* prezero_fill_name(PrezeroFill f) {
  switch (f) {
    case PrezeroFill::kNone: return "none";
    case PrezeroFill::kBase: return "base";
    case PrezeroFill::kAll: return "all";
  }
  return "?";
}

}  // namespace nucleus
