// Helpers shared by the tests: where the shipped models and references are.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "ops/step_inputs.h"

namespace nucleus::testing {

// Sets (value non-null) or unsets an environment variable for one scope and
// restores its value, or its absence, when it goes: for tests of NUCLEUS_*
// switches read when a model or engine is created.
class ScopedEnvValue {
 public:
  ScopedEnvValue(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnvValue() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnvValue(const ScopedEnvValue&) = delete;
  ScopedEnvValue& operator=(const ScopedEnvValue&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};
// Directory holding tiny-dsv3/, tiny-dsv3-fp8/, ref/, configs/ (the project's models/).
std::string models_dir();
std::string model_path(const std::string& name);  // models_dir()/name
// Directory holding the MTP test checkpoints tiny-dsv3/ and tiny-dsv3-fp8/
// (with their model.layers.<num_hidden_layers>.* MTP tensors):
// $NUCLEUS_MTP_DIR when set and not empty (to test another MTP checkpoint,
// e.g. one retrained with tools/train_tiny_mtp.py), else models_dir().
std::string mtp_dir();
// The MTP reference of tools/train_tiny_mtp.py: $NUCLEUS_MTP_DIR/mtp.safetensors,
// else models_dir()/ref/mtp/mtp.safetensors.
std::string mtp_reference_path();
// One sequence's first `rows` tokens of `tokens` as a prefill step from
// position 0 over blocks 0..num_blocks-1 (row i in slot i: the cache's
// blocks in order), every row's logits returned.
StepInputs one_sequence_prefill(const std::vector<int32_t>& tokens, int64_t rows, int64_t num_blocks);
// A fresh empty temporary directory, removed at exit.
std::string make_temp_dir(const std::string& prefix);
}  // namespace nucleus::testing
