#include "ops/op.h"

#include <map>
#include <mutex>
#include <sstream>

#include "core/env.h"

namespace nucleus {

std::string forced_backend(const char* family) {
  static std::once_flag once;
  static std::map<std::string, std::string> forced;
  std::call_once(once, [] {
    auto v = env_string("NUCLEUS_FORCE_KERNEL");
    if (!v) return;
    std::stringstream ss(*v);
    std::string item;
    while (std::getline(ss, item, ',')) {
      auto eq = item.find('=');
      if (eq != std::string::npos) forced[item.substr(0, eq)] = item.substr(eq + 1);
    }
  });
  auto it = forced.find(family);
  return it == forced.end() ? std::string() : it->second;
}

}  // namespace nucleus
