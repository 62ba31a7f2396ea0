#include "ops/moe_decode.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "core/knobs.h"

namespace nucleus {

namespace {

// The switch's largest step, or -1 when malformed.
int64_t parse_switch() {
  static const int64_t v = [] {
    auto s = env_string(Knob::kMoeDecode);
    if (!s) return kMoeDecodeAutoMaxTokens;
    std::string t = *s;
    std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
    if (t.empty() || t == "auto") return kMoeDecodeAutoMaxTokens;
    if (t == "0" || t == "off" || t == "false") return int64_t{0};
    if (t.size() > 2 || !std::all_of(t.begin(), t.end(), [](unsigned char c) { return std::isdigit(c); }))
      return int64_t{-1};
    const int64_t n = std::stoll(t);
    return n >= 1 && n <= kMoeDecodeKernelMaxTokens ? n : int64_t{-1};
  }();
  return v;
}

// An auto / 0 / 1 knob as -1 / 0 / 1 (a malformed value reads as auto until
// moe_up_splits_env_status refuses it).
int tri_switch(Knob knob) {
  switch (env_auto_switch(knob).value_or(AutoSwitch::kAuto)) {
    case AutoSwitch::kOff: return 0;
    case AutoSwitch::kOn: return 1;
    case AutoSwitch::kAuto: break;
  }
  return -1;
}

}  // namespace

int64_t moe_decode_max_tokens() { return std::max<int64_t>(parse_switch(), 0); }

Status moe_decode_env_status() {
  if (parse_switch() < 0)
    return invalid_argument("NUCLEUS_MOE_DECODE='" + *env_string(Knob::kMoeDecode) +
                            "' is not auto, 0 or a token count 1..16");
  return ok_status();
}

int moe_up_splits_switch() {
  auto s = env_string(Knob::kMoeUpSplitK);
  if (!s) return 0;
  std::string t = *s;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t.empty() || t == "auto") return 0;
  if (t == "0" || t == "off" || t == "false" || t == "1") return 1;
  if (t.size() != 1 || t[0] < '2' || t[0] > '8') return -1;
  return t[0] - '0';
}

Status moe_up_splits_env_status() {
  if (moe_up_splits_switch() < 0)
    return invalid_argument("NUCLEUS_MOE_UP_SPLIT_K='" + *env_string(Knob::kMoeUpSplitK) +
                            "' is not auto, 0 or a split count 2..8");
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMoeDeepRing));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMoeAlignFree));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMoeCombinePrefetch));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMoeRouteRegs));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMoeUpStream));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMoeWgmma));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMoeFp8W8a8));
  return ok_status();
}

int moe_deep_ring_switch() { return tri_switch(Knob::kMoeDeepRing); }

int moe_up_stream_switch() { return tri_switch(Knob::kMoeUpStream); }

int moe_wgmma_switch() { return tri_switch(Knob::kMoeWgmma); }

int moe_fp8_w8a8_switch() { return tri_switch(Knob::kMoeFp8W8a8); }

bool moe_align_free_switch() {
  return env_auto_switch(Knob::kMoeAlignFree).value_or(AutoSwitch::kAuto) != AutoSwitch::kOff;
}

bool moe_combine_prefetch_switch() {
  return env_auto_switch(Knob::kMoeCombinePrefetch).value_or(AutoSwitch::kAuto) != AutoSwitch::kOff;
}

bool moe_route_regs_switch() {
  return env_auto_switch(Knob::kMoeRouteRegs).value_or(AutoSwitch::kAuto) != AutoSwitch::kOff;
}

}  // namespace nucleus
