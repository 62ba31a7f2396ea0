#include "ops/op.h"

#include <map>
#include <mutex>
#include <sstream>

#include "core/env.h"

namespace nucleus {

namespace {
std::string g_forced_malformed;  // items of NUCLEUS_FORCE_KERNEL without family=backend
}  // namespace

std::string forced_backend_error() {
  forced_backend("");
  return g_forced_malformed.empty() ? std::string()
                                    : "NUCLEUS_FORCE_KERNEL: '" + g_forced_malformed +
                                          "' is not family=backend (e.g. linear=cuda_naive)";
}

std::string forced_backend(const char* family) {
  static std::once_flag once;
  static std::map<std::string, std::string> forced;
  std::call_once(once, [] {
    auto v = env_string("NUCLEUS_FORCE_KERNEL");
    if (!v) return;
    std::stringstream ss(*v);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.empty()) continue;
      auto eq = item.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
        g_forced_malformed = item;
        continue;
      }
      forced[item.substr(0, eq)] = item.substr(eq + 1);
    }
  });
  auto it = forced.find(family);
  return it == forced.end() ? std::string() : it->second;
}

}  // namespace nucleus
