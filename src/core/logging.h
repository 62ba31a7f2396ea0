// Logging through spdlog (header-only build). Level from NUCLEUS_LOG_LEVEL
// (trace, debug, info, warn, error, off; default info). Logs go to stderr so
// that stdout carries only results (generated text, JSON lines).
#pragma once

#include <spdlog/spdlog.h>

namespace nucleus {
// Creates the stderr logger and applies NUCLEUS_LOG_LEVEL. Idempotent.
void init_logging();
}  // namespace nucleus

#define NUCLEUS_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define NUCLEUS_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define NUCLEUS_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define NUCLEUS_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
