#include "test_util.h"

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

namespace nucleus::testing {

std::string models_dir() {
  if (const char* d = std::getenv("NUCLEUS_MODELS_DIR")) return d;
  return std::string(NUCLEUS_SOURCE_DIR) + "/models";
}

std::string model_path(const std::string& name) { return models_dir() + "/" + name; }

std::string mtp_dir() {
  if (const char* d = std::getenv("NUCLEUS_MTP_DIR"); d && *d) return d;
  return models_dir();
}

std::string mtp_reference_path() {
  if (const char* d = std::getenv("NUCLEUS_MTP_DIR"); d && *d) return std::string(d) + "/mtp.safetensors";
  return models_dir() + "/ref/mtp/mtp.safetensors";
}

namespace {
std::mutex mu;
std::vector<std::string>& temp_dirs() {
  static std::vector<std::string> dirs;
  static bool registered = false;
  if (!registered) {
    registered = true;
    std::atexit([] {
      for (const auto& d : temp_dirs()) {
        std::error_code ec;
        std::filesystem::remove_all(d, ec);
      }
    });
  }
  return dirs;
}
}  // namespace

std::string make_temp_dir(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu);
  std::string templ = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  char* d = mkdtemp(buf.data());
  if (!d) std::abort();
  temp_dirs().push_back(d);
  return d;
}

}  // namespace nucleus::testing
