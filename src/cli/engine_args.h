// Flags shared by `nucleus generate`, `serve` and `bench`: which model, which
// device, and the engine's scheduling and cache settings.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "runtime/llm_engine.h"

namespace nucleus::cli {

struct EngineArgs {
  std::string model;           // model directory
  std::string config_file;     // --config: config.json for --load-format dummy without a directory
  bool skip_tokenizer_init = false;  // serve --skip-tokenizer-init: load no tokenizer (token-id prompts only)
  std::string device = "auto";  // cpu | cuda | auto
  std::string load_format = "auto";  // auto | dummy
  std::vector<std::string> overrides;
  std::string attention_mode = "auto";
  EngineConfig engine;
  std::vector<int64_t> cuda_graph_sizes;  // empty: defaults
  bool enforce_eager = false;
  std::optional<std::vector<int64_t>> token_graph_sizes;  // unset: defaults / env
  int64_t prefill_context_chunk = 8192;
  int64_t tensor_parallel_size = 1;  // --tensor-parallel-size / -tp
  std::string kv_cache_dtype = "auto";  // auto | bf16 | fp8 | fp8_e4m3 (parse_kv_cache_dtype)
  std::optional<double> kv_scale;       // --kv-scale (FP8 cache only)
  bool skip_weight_check = false;       // --skip-weight-check: load without scanning for NaN / Inf
  // --speculative-config: vLLM's JSON, e.g. {"method": "deepseek_mtp",
  // "num_speculative_tokens": 1} (runtime/spec_decode.h); empty: off.
  std::string speculative_config;
  // The parsed --speculative-config (disabled when not given). Errors as
  // parse_speculative_config.
  StatusOr<SpeculativeConfig> speculative() const;

  // The model options these flags give for `device`. kInvalidArgument for a
  // --kv-cache-dtype spelling other than auto, bf16, fp8, fp8_e4m3 (naming
  // them) or a --kv-scale that is not finite and > 0.
  StatusOr<ModelOptions> model_options(Device device) const;
  bool no_prefix_caching = false;

  // Registers the flags on `app`.
  void add_to(CLI::App& app);
};

// The default model: the tiny checkpoint shipped in the repository.
std::string default_model_dir();

struct LoadedEngine {
  // Null only for dummy weights without tokenizer files (prompts must then
  // be token ids).
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<LLMEngine> engine;
  std::string model_dir;
};

// Resolves the device, loads the model (or dummy weights), the tokenizer and
// builds the engine. Errors name the flag or file at fault.
StatusOr<LoadedEngine> load_engine(const EngineArgs& args);

}  // namespace nucleus::cli
