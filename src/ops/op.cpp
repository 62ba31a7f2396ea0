#include "ops/op.h"

#include <map>
#include <mutex>
#include <sstream>

#include "core/env.h"

namespace nucleus {

namespace {
std::string g_forced_malformed;  // items of NUCLEUS_FORCE_KERNEL without family=backend
std::string g_forced_unknown;    // a family no op has

// Every family that dispatches through choose_backend: the ops' kind()
// names and gather_kv_b_proj (ops/gather_kv_b_proj.cpp, kFamily).
const char* const kFamilies[] = {"add_rmsnorm", "all_gather_vocab", "embedding", "gather_kv_b_proj", "gather_rows",
                                 "linear", "mla_decode", "mla_front", "mla_prefill", "moe_experts", "moe_route", "rmsnorm",
                                 "rope_kv_cache_write", "silu_mul"};
}  // namespace

bool is_kernel_family(const std::string& family) {
  for (const char* f : kFamilies)
    if (family == f) return true;
  return false;
}

std::string forced_backend_error() {
  forced_backend("");
  if (!g_forced_malformed.empty())
    return "NUCLEUS_FORCE_KERNEL: '" + g_forced_malformed + "' is not family=backend (e.g. linear=cuda_naive)";
  if (!g_forced_unknown.empty()) {
    std::string known;
    for (const char* f : kFamilies) known += std::string(known.empty() ? "" : ", ") + f;
    return "NUCLEUS_FORCE_KERNEL: no kernel family '" + g_forced_unknown + "' (families: " + known + ")";
  }
  return std::string();
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
      const std::string family = item.substr(0, eq);
      if (!is_kernel_family(family) && g_forced_unknown.empty()) g_forced_unknown = family;
      forced[family] = item.substr(eq + 1);
    }
  });
  auto it = forced.find(family);
  return it == forced.end() ? std::string() : it->second;
}

}  // namespace nucleus
