#include "graph/fault_injection.h"

#include <cstdlib>

namespace nucleus {

StatusOr<std::optional<FaultPlan>> parse_fault_plan(const std::string& value) {
  if (value.empty()) return std::optional<FaultPlan>();
  auto bad = [&] {
    return invalid_argument("NUCLEUS_FAULT_INJECT='" + value + "' is not <op kind>:<n>[:fatal] with n >= 1 " +
                            "(e.g. embedding:3)");
  };
  const size_t a = value.find(':');
  if (a == std::string::npos || a == 0) return bad();
  FaultPlan p;
  p.kind = value.substr(0, a);
  const size_t b = value.find(':', a + 1);
  const std::string n = value.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
  if (b != std::string::npos) {
    if (value.substr(b + 1) != "fatal") return bad();
    p.fatal = true;
  }
  char* end = nullptr;
  p.nth = n.empty() ? 0 : std::strtoll(n.c_str(), &end, 10);
  if (n.empty() || *end != '\0' || p.nth < 1) return bad();
  return std::optional<FaultPlan>(p);
}

Status FaultInjector::before_run(const char* kind, const std::string& node) {
  if (plan_.kind != kind || ++calls_ != plan_.nth) return ok_status();
  fatal_fired_ = plan_.fatal;
  return internal_error("injected fault in op " + plan_.kind + " (node " + node + ", run " +
                        std::to_string(plan_.nth) + ", NUCLEUS_FAULT_INJECT" + (plan_.fatal ? ", fatal" : "") + ")");
}

}  // namespace nucleus
