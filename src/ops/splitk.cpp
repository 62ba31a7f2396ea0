#include "ops/splitk.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <string>

#include "core/knobs.h"

namespace nucleus {

namespace {

constexpr int64_t kMaxRows = 64;  // kernels::kSplitKMaxRows (the kernel header is CUDA-only)

// -1: malformed.
int parse_switch() {
  static const int v = [] {
    auto s = env_string(Knob::kSplitK);
    // Unset: the measured rule when the prezero pass is on (split-K GEMMs are
    // its only consumers on CUDA; with it, auto is 1-5% faster per decode step
    // at batch 1-8 on V2-Lite), else off (split-K with its zeroing memsets is
    // 0-2% slower than cuBLASLt there). docs/perf.md, "Split-K decode GEMMs and prezero".
    if (!s)
      return static_cast<int>(env_flag(Knob::kEnablePrezero) ? SplitKSwitch::kAuto : SplitKSwitch::kOff);
    std::string t = *s;
    std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
    if (t == "auto" || t.empty()) return static_cast<int>(SplitKSwitch::kAuto);
    if (t == "0" || t == "off" || t == "false") return static_cast<int>(SplitKSwitch::kOff);
    if (t == "1" || t == "on" || t == "true") return static_cast<int>(SplitKSwitch::kOn);
    return -1;
  }();
  return v;
}

std::atomic<int> g_deterministic{-1};  // -1: from the environment

}  // namespace

SplitKSwitch splitk_switch() {
  const int v = parse_switch();
  return v < 0 ? SplitKSwitch::kOff : static_cast<SplitKSwitch>(v);
}

Status splitk_env_status() {
  if (parse_switch() < 0)
    return invalid_argument("NUCLEUS_SPLITK='" + *env_string(Knob::kSplitK) + "' is not auto, 0 or 1");
  return ok_status();
}

int64_t splitk_max_rows(int64_t n, int64_t k) {
  switch (splitk_switch()) {
    case SplitKSwitch::kOff: return 0;
    case SplitKSwitch::kOn: return kMaxRows;
    case SplitKSwitch::kAuto: break;
  }
  const int64_t bytes = n * k * 2;
  if (n <= 256) return kMaxRows;
  if (n <= 1024 && bytes <= kSplitKSmallWeightBytes) return 32;
  if (n <= 2048) return bytes <= kSplitKMediumWeightBytes ? 16 : 8;
  return 0;
}

bool splitk_deterministic() {
  const int v = g_deterministic.load();
  if (v >= 0) return v == 1;
  static const bool env = env_flag(Knob::kSplitKDeterministic);
  return env;
}

void set_splitk_deterministic(bool on) { g_deterministic.store(on ? 1 : 0); }
void reset_splitk_deterministic() { g_deterministic.store(-1); }

}  // namespace nucleus
