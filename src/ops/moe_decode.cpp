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

}  // namespace

int64_t moe_decode_max_tokens() { return std::max<int64_t>(parse_switch(), 0); }

Status moe_decode_env_status() {
  if (parse_switch() < 0)
    return invalid_argument("NUCLEUS_MOE_DECODE='" + *env_string(Knob::kMoeDecode) +
                            "' is not auto, 0 or a token count 1..16");
  return ok_status();
}

}  // namespace nucleus
