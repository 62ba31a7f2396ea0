#include "ops/prezero.h"

#include <atomic>
#include <cstdlib>

#include "core/knobs.h"
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

namespace {
std::atomic<int64_t> g_idle_bytes_override{0};

// The env value, 0 when unset, -1 when malformed.
int64_t idle_bytes_env_value() {
  static const int64_t v = [] {
    auto s = env_string(Knob::kPrezeroIdleBytesPerSm);
    if (!s) return int64_t{0};
    char* end = nullptr;
    const long long b = std::strtoll(s->c_str(), &end, 10);
    return !s->empty() && *end == '\0' && b > 0 ? static_cast<int64_t>(b) : int64_t{-1};
  }();
  return v;
}

int64_t idle_bytes_from_env() {
  const int64_t v = idle_bytes_env_value();
  return v > 0 ? v : kPrezeroIdleBytesPerSm;
}
}  // namespace

Status prezero_env_status() {
  if (idle_bytes_env_value() < 0)
    return invalid_argument("NUCLEUS_PREZERO_IDLE_BYTES_PER_SM='" + *env_string(Knob::kPrezeroIdleBytesPerSm) +
                            "' is not a positive byte count (e.g. 65536)");
  return ok_status();
}

int64_t prezero_idle_bytes_per_sm() {
  const int64_t o = g_idle_bytes_override.load();
  return o > 0 ? o : idle_bytes_from_env();
}

void set_prezero_idle_bytes_per_sm(int64_t bytes) { g_idle_bytes_override.store(bytes > 0 ? bytes : 0); }

bool is_prezero_free(int64_t m, int64_t n) {
  const int64_t sms = prezero_sm_count();
  if (m <= 0 || m >= sms) return false;
  return m * n * 4 <= (sms - m) * prezero_idle_bytes_per_sm();
}

PrezeroFill prezero_fill(int64_t m, int64_t n_total, int64_t n_base, int64_t max_rows) {
  if (m > max_rows) return PrezeroFill::kNone;
  if (is_prezero_free(m, n_total)) return PrezeroFill::kAll;
  if (n_base > 0 && is_prezero_free(m, n_base)) return PrezeroFill::kBase;
  return PrezeroFill::kNone;
}

int64_t prezero_fill_count(const PrezeroDonor& d, int64_t m) {
  if (d.n_total <= 0) return 0;
  switch (prezero_fill(m, d.n_total, d.n_base, d.max_rows)) {
    case PrezeroFill::kAll: return m * d.n_total;
    case PrezeroFill::kBase: return m * d.n_base;
    case PrezeroFill::kNone: break;
  }
  return 0;
}

std::string prezero_attrs(const PrezeroDonor& d) {
  if (d.n_total <= 0) return {};
  return " prezero_n_total=" + std::to_string(d.n_total) + " prezero_n_base=" + std::to_string(d.n_base) +
         (d.max_rows == kPrezeroAnyRows ? "" : " prezero_max_rows=" + std::to_string(d.max_rows));
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
