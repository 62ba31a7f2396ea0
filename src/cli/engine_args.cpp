#include "cli/engine_args.h"

#include <filesystem>

#include "core/device.h"
#include "core/logging.h"

namespace nucleus::cli {

std::string default_model_dir() { return std::string(NUCLEUS_SOURCE_DIR) + "/models/tiny-dsv3"; }

void EngineArgs::add_to(CLI::App& app) {
  model = default_model_dir();
  app.add_option("--model", model, "Model directory (Hugging Face layout)")->capture_default_str();
  app.add_option("--device", device, "cpu, cuda or auto (cuda when a GPU is present)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  app.add_option("--load-format", load_format, "auto (checkpoint) or dummy (random weights from config.json)")
      ->check(CLI::IsMember({"auto", "dummy"}))
      ->capture_default_str();
  app.add_option("--override", overrides, "Override a config.json field, KEY=VALUE (repeatable)");
  app.add_option("--attention-mode", attention_mode, "MLA form: auto, expanded or absorbed")
      ->check(CLI::IsMember({"auto", "expanded", "absorbed"}))
      ->capture_default_str();
  app.add_option("--block-size", engine.block_size, "Tokens per KV-cache block")->capture_default_str();
  app.add_option("--num-kv-blocks", engine.num_kv_blocks, "KV-cache blocks (0: derived from memory)")
      ->capture_default_str();
  app.add_option("--gpu-memory-utilization", engine.gpu_memory_utilization,
                 "Fraction of GPU memory for weights, activations and the KV cache")
      ->capture_default_str();
  app.add_option("--max-num-batched-tokens", engine.max_num_batched_tokens, "Token budget per step")
      ->capture_default_str();
  app.add_option("--max-num-seqs", engine.max_num_seqs, "Sequences per step at most")->capture_default_str();
  app.add_option("--max-model-len", engine.max_model_len, "Prompt + output length limit (0: the model's)")
      ->capture_default_str();
  app.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", engine.enable_prefix_caching,
               "Reuse cached KV blocks of shared prompt prefixes (default on)");
}

StatusOr<LoadedEngine> load_engine(const EngineArgs& args) {
  LoadedEngine out;
  out.model_dir = args.model;
  if (!std::filesystem::is_directory(args.model))
    return not_found("--model '" + args.model + "' is not a directory");
  ModelOptions mo;
  NUCLEUS_ASSIGN_OR_RETURN(mo.device, resolve_device(args.device));
  mo.scratch_rows = std::min<int64_t>(args.engine.max_num_seqs, 256);
  NUCLEUS_ASSIGN_OR_RETURN(mo.attention_mode, parse_attention_mode(args.attention_mode));
  NUCLEUS_ASSIGN_OR_RETURN(out.tokenizer, Tokenizer::load(args.model));
  std::unique_ptr<DeepseekModel> model;
  if (args.load_format == "dummy") {
    NUCLEUS_ASSIGN_OR_RETURN(ModelConfig config,
                             load_model_config((std::filesystem::path(args.model) / "config.json").string(),
                                               args.overrides));
    auto backend = make_weight_backend(mo.device);
    NUCLEUS_ASSIGN_OR_RETURN(ModelWeights w, make_dummy_weights(config, *backend));
    NUCLEUS_ASSIGN_OR_RETURN(model, DeepseekModel::create(config, std::move(w), mo));
  } else {
    NUCLEUS_ASSIGN_OR_RETURN(model, load_deepseek_model(args.model, mo, args.overrides));
  }
  EngineConfig ec = args.engine;
  if (ec.eos_token_ids.empty() && out.tokenizer->eos_id()) ec.eos_token_ids.push_back(*out.tokenizer->eos_id());
  NUCLEUS_ASSIGN_OR_RETURN(out.engine, LLMEngine::create(std::move(model), ec));
  return out;
}

}  // namespace nucleus::cli
