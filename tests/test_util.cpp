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

StepInputs one_sequence_prefill(const std::vector<int32_t>& tokens, int64_t rows, int64_t num_blocks) {
  StepInputs in;
  in.query_start = {0, static_cast<int32_t>(rows)};
  in.context_lens = {0};
  in.max_blocks_per_seq = static_cast<int32_t>(num_blocks);
  for (int32_t b = 0; b < num_blocks; ++b) in.block_tables.push_back(b);
  for (int64_t i = 0; i < rows; ++i) {
    in.token_ids.push_back(tokens[i]);
    in.positions.push_back(static_cast<int32_t>(i));
    in.slot_mapping.push_back(i);
    in.logit_indices.push_back(static_cast<int32_t>(i));
  }
  return in;
}

}  // namespace nucleus::testing
