// Environment switches (NUCLEUS_*). Read where used; each switch is documented
// at its point of use and in docs/flags.md.
#pragma once

#include <optional>
#include <string>

namespace nucleus {
// The variable's value, or nullopt when unset.
std::optional<std::string> env_string(const char* name);
// "1", "true", "yes", "on" (any case) are true; "0", "false", "no", "off", "" false.
bool env_flag(const char* name, bool default_value = false);
}  // namespace nucleus
