#include "core/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>

#include "core/knobs.h"

namespace nucleus {

void init_logging() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto logger = spdlog::stderr_color_mt("nucleus");
    logger->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
    spdlog::set_default_logger(logger);
    spdlog::level::level_enum level = spdlog::level::info;
    if (auto env = env_string(Knob::kLogLevel)) {
      const std::string v = *env;
      level = spdlog::level::from_str(v);
      if (level == spdlog::level::off && v != "off") {  // from_str's answer for unknown names
        level = spdlog::level::info;
        spdlog::set_level(level);
        spdlog::warn("NUCLEUS_LOG_LEVEL='{}' is not one of trace, debug, info, warn, error, off; using info", v);
      }
    }
    spdlog::set_level(level);
  });
}

}  // namespace nucleus
