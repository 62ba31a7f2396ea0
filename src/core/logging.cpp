#include "core/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>

namespace nucleus {

void init_logging() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto logger = spdlog::stderr_color_mt("nucleus");
    logger->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
    spdlog::set_default_logger(logger);
    spdlog::level::level_enum level = spdlog::level::info;
    if (const char* env = std::getenv("NUCLEUS_LOG_LEVEL")) level = spdlog::level::from_str(env);
    spdlog::set_level(level);
  });
}

}  // namespace nucleus
