#include "core/env.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

namespace nucleus {

std::optional<std::string> env_string(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

bool env_flag(const char* name, bool default_value) {
  auto v = env_string(name);
  if (!v) return default_value;
  std::string s = *v;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  return false;
}

}  // namespace nucleus
