#include "cli/engine_args.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "cli/commands.h"
#include "core/device.h"
#include "core/knobs.h"
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
  app.add_option("--config", config_file, "config.json to build the model from (with --load-format dummy)");
  app.add_option("--override", overrides, "Override a config.json field, KEY=VALUE (repeatable)");
  app.add_option("--attention-mode", attention_mode, "MLA form: auto, expanded or absorbed")
      ->check(CLI::IsMember({"auto", "expanded", "absorbed"}))
      ->capture_default_str();
  // Range checks here make a bad value a usage error (exit 2) before any
  // model is loaded; EngineConfig::validate checks the same for the C++ API.
  app.add_option("--block-size", engine.block_size, "Tokens per KV-cache block")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--num-kv-blocks", engine.num_kv_blocks, "KV-cache blocks (0: derived from memory)")
      ->capture_default_str()
      ->check(non_negative_number());
  app.add_option("--gpu-memory-utilization", engine.gpu_memory_utilization,
                 "Fraction of GPU memory for weights, activations and the KV cache")
      ->capture_default_str()
      ->check(positive_number() & CLI::Range(0.0, 1.0));
  app.add_option("--max-num-batched-tokens", engine.max_num_batched_tokens, "Token budget per step")
      ->capture_default_str()
      ->check(positive_number());
  app.add_option("--max-num-seqs", engine.max_num_seqs, "Sequences per step at most")
      ->capture_default_str()
      ->check(positive_number());
  app.add_option("--max-model-len", engine.max_model_len, "Prompt + output length limit (0: the model's)")
      ->capture_default_str()
      ->check(non_negative_number());
  app.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", engine.enable_prefix_caching,
               "Reuse cached KV blocks of shared prompt prefixes (default on)");
  app.add_option("--cuda-graph-sizes", cuda_graph_sizes,
                 "Decode batch sizes captured as CUDA graphs (default 1,2,4,8,16,24,32,48,64, then every 32 to 512, "
                 "capped by --max-num-seqs; with --speculative-config by --max-num-seqs x (1 + num_speculative_tokens))")
      ->delimiter(',');
  app.add_flag("--enforce-eager", enforce_eager, "Run every step eagerly (no CUDA graphs)");
  app.add_option_function<std::vector<int64_t>>(
         "--token-graph-sizes", [this](const std::vector<int64_t>& v) { token_graph_sizes = v; },
         "Prefill token-graph buckets (default 256,512,1024,2048,3072 or NUCLEUS_TOKEN_GRAPH_SIZES; '' disables)")
      ->delimiter(',')
      ->expected(0, -1);
  app.add_option("--tensor-parallel-size", tensor_parallel_size,
                 "Tensor-parallel ranks (-tp): GPUs 0..N-1 over NCCL on CUDA, threads on the CPU")
      ->capture_default_str()
      ->check(CLI::Range(1, 8));
  app.add_option("--prefill-context-chunk", prefill_context_chunk,
                 "Cached rows expanded at a time in prefill attention (longer contexts are merged by log-sum-exp)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--kv-cache-dtype", kv_cache_dtype,
                 "Latent KV-cache storage: auto (bf16 on CUDA, f32 on the CPU), bf16, fp8 / fp8_e4m3 (e4m3 with a "
                 "per-layer k_scale: half the bytes of bf16), or fp8_ds_mla (e4m3 latent with one f32 scale per 128 "
                 "values, rope in bf16: 656 bytes a row, as FlashMLA's FP8 cache)")
      ->capture_default_str()
      ->check([](const std::string& v) {  // one parser for every spelling: a usage error (exit 2) otherwise
        auto r = parse_kv_cache_dtype(v);
        if (r.ok()) return std::string();
        // CLI11 prefixes the option's name: drop parse_kv_cache_dtype's own.
        const std::string m = r.status().message(), own = "--kv-cache-dtype ";
        return m.compare(0, own.size(), own) == 0 ? m.substr(own.size()) : m;
      });
  app.add_flag("--skip-weight-check", skip_weight_check,
               "Load the checkpoint without scanning its values (by default a NaN or Inf weight, an FP8 NaN byte "
               "or a block scale not finite and > 0 is refused at load, naming the tensor)");
  app.add_option("--speculative-config", speculative_config,
                 "Speculative decoding, vLLM's JSON: '{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": N}' "
                 "(N 1 to 3; drafts from the checkpoint's MTP layer, verified by the model)")
      ->check([](const std::string& v) {
        auto r = parse_speculative_config(v);
        if (r.ok()) return std::string();
        const std::string m = r.status().message(), own = "--speculative-config: ";  // CLI11 names the option
        return m.compare(0, own.size(), own) == 0 ? m.substr(own.size()) : m;
      });
  app.add_option_function<double>(
         "--kv-scale", [this](double v) { kv_scale = v; },
         "k_scale of every layer of an fp8 / fp8_e4m3 KV cache (stored = e4m3(value / k_scale)), overriding the "
         "checkpoint's k_scale / kv_scale tensors (default: those, else 1.0); refused with fp8_ds_mla")
      ->check([](const std::string& v) {
        char* end = nullptr;
        const float f = std::strtof(v.c_str(), &end);
        Status s = end && *end == '\0' ? check_k_scale(f, "--kv-scale") : invalid_argument("--kv-scale '" + v + "' is not a number");
        return s.ok() ? std::string() : s.message();
      });
}

StatusOr<SpeculativeConfig> EngineArgs::speculative() const {
  if (speculative_config.empty()) return SpeculativeConfig{};
  return parse_speculative_config(speculative_config);
}

StatusOr<ModelOptions> EngineArgs::model_options(Device device) const {
  ModelOptions mo;
  mo.device = device;
  NUCLEUS_ASSIGN_OR_RETURN(SpeculativeConfig spec, speculative());
  mo.load_mtp = spec.enabled();
  NUCLEUS_ASSIGN_OR_RETURN(mo.attention_mode, parse_attention_mode(attention_mode));
  mo.scratch_rows = std::min<int64_t>(engine.max_num_seqs, 256);
  mo.prefill_context_chunk = prefill_context_chunk;
  mo.graph_eager_pad = env_flag(Knob::kGraphEagerPad);
  mo.token_graph_eager_pad = env_flag(Knob::kTokenGraphEagerPad);
  mo.enable_prezero = env_flag(Knob::kEnablePrezero);
  mo.multi_token_decode = env_flag(Knob::kMultiTokenDecode);
  mo.tensor_parallel_size = tensor_parallel_size;
  mo.check_weights = !skip_weight_check;
  mo.fuse_allreduce_norm = env_flag(Knob::kFuseAllreduceNorm);
  NUCLEUS_ASSIGN_OR_RETURN(mo.width_builds, width::width_builds_mode_from_env());
  NUCLEUS_ASSIGN_OR_RETURN(mo.kv_cache_dtype, parse_kv_cache_dtype(kv_cache_dtype));
  if (kv_scale) {
    const auto f = static_cast<float>(*kv_scale);
    NUCLEUS_RETURN_IF_ERROR(check_k_scale(f, "--kv-scale"));
    mo.kv_scale = f;
  }
  // NUCLEUS_TOKEN_GRAPH_SIZES is checked on every device (a malformed switch
  // is refused, not ignored), used on CUDA without --enforce-eager.
  NUCLEUS_ASSIGN_OR_RETURN(std::vector<int64_t> env_token_graph_sizes,
                           token_graph_sizes_from_env(engine.max_num_batched_tokens));
  if (device == Device::kCuda && !enforce_eager) {
    if (token_graph_sizes) {
      for (int64_t s : *token_graph_sizes)
        if (s < 1) return invalid_argument("--token-graph-sizes: " + std::to_string(s) + " is not positive");
      for (int64_t s : *token_graph_sizes)
        if (s <= engine.max_num_batched_tokens) mo.token_graph_sizes.push_back(s);
      std::sort(mo.token_graph_sizes.begin(), mo.token_graph_sizes.end());
    } else {
      mo.token_graph_sizes = std::move(env_token_graph_sizes);
    }
  }
  if (device == Device::kCuda && !enforce_eager) {
    // A decode graph's rows: one a sequence, or with speculative decoding
    // (verify steps as decode rows) up to 1 + k a sequence.
    const int64_t max_rows =
        mo.multi_token_decode ? engine.max_num_seqs * (1 + spec.num_speculative_tokens) : engine.max_num_seqs;
    mo.cuda_graph_sizes = cuda_graph_sizes.empty() ? default_cuda_graph_sizes(max_rows) : cuda_graph_sizes;
    std::sort(mo.cuda_graph_sizes.begin(), mo.cuda_graph_sizes.end());
    mo.cuda_graph_sizes.erase(std::unique(mo.cuda_graph_sizes.begin(), mo.cuda_graph_sizes.end()),
                              mo.cuda_graph_sizes.end());
    for (int64_t s : mo.cuda_graph_sizes)
      if (s < 1 || s > max_rows)
        return invalid_argument("--cuda-graph-sizes: " + std::to_string(s) + " is outside [1, " +
                                std::to_string(max_rows) +
                                (max_rows == engine.max_num_seqs
                                     ? " (--max-num-seqs)]"
                                     : " (--max-num-seqs x (1 + num_speculative_tokens))]"));
  }
  return mo;
}

StatusOr<LoadedEngine> load_engine(const EngineArgs& args) {
  namespace fs = std::filesystem;
  LoadedEngine out;
  out.model_dir = args.model;
  const bool dummy = args.load_format == "dummy";
  if (!args.config_file.empty() && !dummy)
    return invalid_argument("--config needs --load-format dummy (a checkpoint is read with --model DIR)");
  if (args.config_file.empty() && !fs::is_directory(args.model))
    return not_found("--model '" + args.model + "' is not a directory");
  NUCLEUS_ASSIGN_OR_RETURN(Device device, resolve_device(args.device));
  NUCLEUS_ASSIGN_OR_RETURN(ModelOptions mo, args.model_options(device));
  // config.json (or --config), read once: the tokenizer and generation_config.json
  // checks below and a dummy model use it, all before any weight is read.
  const std::string cfg =
      args.config_file.empty() ? (fs::path(args.model) / "config.json").string() : args.config_file;
  NUCLEUS_ASSIGN_OR_RETURN(const ModelConfig config, load_model_config(cfg, args.overrides));
  // tokenizer.json, or Kimi-K2's tiktoken.model.
  const bool has_tokenizer = args.config_file.empty() && (fs::exists(fs::path(args.model) / "tokenizer.json") ||
                                                          fs::exists(fs::path(args.model) / "tiktoken.model"));
  if (!args.skip_tokenizer_init && (has_tokenizer || !dummy)) {
    NUCLEUS_ASSIGN_OR_RETURN(out.tokenizer, Tokenizer::load(args.model));
    // Every token must have a row of the embedding and of the head: a tokenizer
    // id at or past config.json's vocab_size is refused before the weights are
    // read (a prompt holding it failed at request time, and the id the model
    // could sample for it decoded to nothing).
    if (out.tokenizer->vocab_size() > config.vocab_size) {
      const int32_t id = static_cast<int32_t>(out.tokenizer->vocab_size() - 1);
      return invalid_argument(args.model + ": the tokenizer's token '" + out.tokenizer->id_to_token(id) + "' has id " +
                              std::to_string(id) + ", outside config.json's vocab_size " +
                              std::to_string(config.vocab_size));
    }
  }
  std::vector<int64_t> gen_eos;
  if (args.config_file.empty()) {
    NUCLEUS_ASSIGN_OR_RETURN(gen_eos, load_generation_eos_token_ids(
                                          (fs::path(args.model) / "generation_config.json").string(), config.vocab_size));
  }
  std::unique_ptr<ModelExecutor> model;
  if (dummy) {
    NUCLEUS_ASSIGN_OR_RETURN(model, build_deepseek_model(config, mo, [&](WeightBackend& backend, const TpShard& shard) {
                               return make_dummy_weights(config, backend, 0, shard, mo.load_mtp);
                             }));
  } else {
    NUCLEUS_ASSIGN_OR_RETURN(model, load_deepseek_model(args.model, mo, args.overrides));
  }
  EngineConfig ec = args.engine;
  NUCLEUS_ASSIGN_OR_RETURN(ec.speculative, args.speculative());
  if (ec.eos_token_ids.empty() && out.tokenizer && out.tokenizer->eos_id())
    ec.eos_token_ids.push_back(*out.tokenizer->eos_id());
  // generation_config.json's eos_token_id(s) stop generation too, as in
  // Hugging Face's generate() and vLLM (with the tokenizer's eos, or else
  // config.json's, which the engine falls back to).
  if (!gen_eos.empty() && ec.eos_token_ids.empty())
    for (int64_t id : model->config().eos_token_ids) ec.eos_token_ids.push_back(static_cast<int32_t>(id));
  for (int64_t id : gen_eos)
    if (std::find(ec.eos_token_ids.begin(), ec.eos_token_ids.end(), id) == ec.eos_token_ids.end())
      ec.eos_token_ids.push_back(static_cast<int32_t>(id));
  NUCLEUS_ASSIGN_OR_RETURN(out.engine, LLMEngine::create(std::move(model), ec));
  return out;
}

}  // namespace nucleus::cli
