#include "io/hf_config.h"

#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "io/regular_file.h"

namespace nucleus {

using json = nlohmann::json;

const char* scoring_func_name(ScoringFunc f) { return f == ScoringFunc::kSoftmax ? "softmax" : "sigmoid"; }

const char* topk_method_name(TopkMethod m) {
  switch (m) {
    case TopkMethod::kGreedy: return "greedy";
    case TopkMethod::kGroupLimitedGreedy: return "group_limited_greedy";
    case TopkMethod::kNoauxTc: return "noaux_tc";
  }
  return "?";
}

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double ModelConfig::softmax_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (rope_scaling.yarn && rope_scaling.mscale_all_dim != 0.0) {
    double m = yarn_get_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

namespace {

// Bounds of config values. Each keeps the buffers sized from a field (RoPE
// tables, block tables, weights) and their int64 products sane; real
// DeepSeek models sit far inside them (V3: 163840 positions, hidden 7168,
// 61 layers, 256 experts).
constexpr int64_t kMaxField = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxPositions = int64_t{1} << 24;  // 16,777,216 tokens of context
constexpr int64_t kMaxVocab = int64_t{1} << 24;      // token ids fit int32 with room
constexpr int64_t kMaxWidth = int64_t{1} << 20;      // hidden, intermediate, LoRA ranks, head dims
constexpr int64_t kMaxCount = int64_t{1} << 12;      // layers, heads
constexpr int64_t kMaxExperts = int64_t{1} << 16;
constexpr double kMaxScaling = 1e6;                  // routed_scaling_factor, rope_scaling.factor

// A value for a message: JSON, but "inf" / "nan" where dump() would write null.
std::string value_text(const json& v) {
  if (v.is_number_float() && !std::isfinite(v.get<double>()))
    return std::isnan(v.get<double>()) ? "nan" : v.get<double>() > 0 ? "inf" : "-inf";
  return v.dump();
}

// "field 'key' must be <what>, got <v>" unless ok.
Status require(bool ok, const std::string& key, const std::string& what, double v) {
  if (ok) return ok_status();
  return invalid_argument("field '" + key + "' must be " + what + ", got " + value_text(v));
}

// Field readers: each names the field when its type or value is wrong.
class Reader {
 public:
  // `prefix` names the enclosing object in messages ("rope_scaling.").
  explicit Reader(const json& j, std::string prefix = "") : j_(j), prefix_(std::move(prefix)) {}

  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }

  // An integer in [min_value, max_value] (the bounds are in the error).
  Status int_field(const char* key, int64_t* out, bool required, int64_t min_value = 0,
                   int64_t max_value = kMaxField) const {
    if (!has(key)) return required ? invalid_argument("missing field '" + prefix_ + key + "'")
                                   : ok_status();
    const json& v = j_[key];
    if (!v.is_number_integer())
      return invalid_argument("field '" + prefix_ + key + "' must be an integer, got " + v.dump());
    // Non-negative literals parse as uint64: one past int64 must not wrap.
    const bool unsigned_big = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(max_value);
    if (unsigned_big || v.get<int64_t>() < min_value || v.get<int64_t>() > max_value)
      return invalid_argument("field '" + prefix_ + key + "' must be " +
                              (max_value == kMaxField ? ">= " + std::to_string(min_value)
                                                      : "in [" + std::to_string(min_value) + ", " +
                                                            std::to_string(max_value) + "]") +
                              ", got " + v.dump());
    *out = v.get<int64_t>();
    return ok_status();
  }

  // A finite number (JSON has no NaN, but 1e999 parses as infinity).
  Status double_field(const char* key, double* out, bool required) const {
    if (!has(key)) return required ? invalid_argument("missing field '" + prefix_ + key + "'")
                                   : ok_status();
    const json& v = j_[key];
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      return invalid_argument("field '" + prefix_ + key + "' must be a finite number, got " + value_text(v));
    *out = v.get<double>();
    return ok_status();
  }

  Status bool_field(const char* key, bool* out) const {
    if (!has(key)) return ok_status();
    const json& v = j_[key];
    if (!v.is_boolean())
      return invalid_argument("field '" + prefix_ + key + "' must be true or false, got " + v.dump());
    *out = v.get<bool>();
    return ok_status();
  }

  Status string_field(const char* key, std::string* out, bool required) const {
    if (!has(key)) return required ? invalid_argument("missing field '" + prefix_ + key + "'")
                                   : ok_status();
    const json& v = j_[key];
    if (!v.is_string())
      return invalid_argument("field '" + prefix_ + key + "' must be a string, got " + v.dump());
    *out = v.get<std::string>();
    return ok_status();
  }

 private:
  const json& j_;
  std::string prefix_;
};

Status parse_rope_scaling(const json& j, RopeScaling* rs) {
  if (!j.contains("rope_scaling") || j["rope_scaling"].is_null()) return ok_status();
  const json& r = j["rope_scaling"];
  if (!r.is_object()) return invalid_argument("field 'rope_scaling' must be an object or null");
  std::string type;
  Reader rr(r, "rope_scaling.");
  // Transformers reads rope_type and falls back to the older 'type' (both
  // present: rope_type wins).
  if (rr.has("rope_type")) {
    NUCLEUS_RETURN_IF_ERROR(rr.string_field("rope_type", &type, true));
  } else if (rr.has("type")) {
    NUCLEUS_RETURN_IF_ERROR(rr.string_field("type", &type, true));
  } else {
    return invalid_argument("rope_scaling has neither 'type' nor 'rope_type'");
  }
  if (type == "default") return ok_status();
  if (type != "yarn")
    return unsupported("rope_scaling type '" + type + "' is not supported (supported: yarn, default)");
  rs->yarn = true;
  NUCLEUS_RETURN_IF_ERROR(rr.double_field("factor", &rs->factor, true));
  NUCLEUS_RETURN_IF_ERROR(rr.int_field("original_max_position_embeddings", &rs->original_max_position_embeddings,
                                       true, 1, kMaxPositions));
  NUCLEUS_RETURN_IF_ERROR(rr.double_field("beta_fast", &rs->beta_fast, false));
  NUCLEUS_RETURN_IF_ERROR(rr.double_field("beta_slow", &rs->beta_slow, false));
  NUCLEUS_RETURN_IF_ERROR(rr.double_field("mscale", &rs->mscale, false));
  NUCLEUS_RETURN_IF_ERROR(rr.double_field("mscale_all_dim", &rs->mscale_all_dim, false));
  NUCLEUS_RETURN_IF_ERROR(require(rs->factor > 0 && rs->factor <= kMaxScaling, "rope_scaling.factor",
                                  "in (0, 1e6]", rs->factor));
  // YaRN's ramp runs from the dimension of beta_fast rotations to that of
  // beta_slow ones (ln(L0 / (2 pi beta)) needs beta > 0). Equal betas are a
  // step, as Hugging Face's ramp makes them (Kimi-K2 ships beta_fast ==
  // beta_slow == 1); swapped ones would reverse it, a typo rather than a
  // trained model.
  NUCLEUS_RETURN_IF_ERROR(require(rs->beta_slow > 0, "rope_scaling.beta_slow", "> 0", rs->beta_slow));
  if (!(rs->beta_fast >= rs->beta_slow))
    return invalid_argument("field 'rope_scaling.beta_fast' must be >= rope_scaling.beta_slow " +
                            value_text(rs->beta_slow) + ", got " + value_text(rs->beta_fast));
  // mscale >= 0 keeps yarn_get_mscale >= 1, a divisor of the attention factor.
  NUCLEUS_RETURN_IF_ERROR(require(rs->mscale >= 0, "rope_scaling.mscale", ">= 0", rs->mscale));
  NUCLEUS_RETURN_IF_ERROR(
      require(rs->mscale_all_dim >= 0, "rope_scaling.mscale_all_dim", ">= 0", rs->mscale_all_dim));
  return ok_status();
}

// torch_dtype (or its newer spelling dtype): the float dtype of the
// checkpoint's tensors, which load_weights holds them to.
Status parse_torch_dtype(const Reader& r, std::optional<DType>* out) {
  const char* key = r.has("torch_dtype") ? "torch_dtype" : "dtype";
  std::string name;
  NUCLEUS_RETURN_IF_ERROR(r.string_field(key, &name, false));
  if (name.empty()) return ok_status();
  if (name == "bfloat16") *out = DType::kBF16;
  else if (name == "float16") *out = DType::kF16;
  else if (name == "float32") *out = DType::kF32;
  else
    return unsupported(std::string("field '") + key + "' '" + name +
                       "' is not supported (supported: bfloat16, float16, float32)");
  return ok_status();
}

// Fields parse_model_config reads (an override may add one of these even
// when config.json lacks it; any other key must already be in the file, so a
// typo is an error instead of a silently ignored flag).
const char* const kKnownFields[] = {
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "n_routed_experts",
    "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
    "first_k_dense_replace", "moe_layer_freq", "norm_topk_prob", "routed_scaling_factor", "scoring_func",
    "topk_method", "hidden_act", "attention_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "quantization_config", "torch_dtype", "dtype", "num_nextn_predict_layers"};

Status apply_overrides(json* j, const std::vector<std::string>& overrides) {
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0)
      return invalid_argument("--override '" + o + "': expected KEY=VALUE");
    std::string key = o.substr(0, eq), value = o.substr(eq + 1);
    bool known = j->contains(key);
    for (const char* f : kKnownFields) known |= key == f;
    if (!known)
      return invalid_argument("--override '" + o + "': config.json has no field '" + key +
                              "' and nucleus reads none of that name");
    json v = json::parse(value, nullptr, /*allow_exceptions=*/false);
    (*j)[key] = v.is_discarded() ? json(value) : v;
  }
  return ok_status();
}

}  // namespace

namespace {
// eos_token_id of a config.json or generation_config.json object: an integer
// or a list of them, each in [0, vocab_size); none when absent or null.
StatusOr<std::vector<int64_t>> eos_token_ids_of(const json& j, int64_t vocab_size) {
  std::vector<int64_t> ids;
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return ids;
  const json& e = j["eos_token_id"];
  if (e.is_number_integer()) {
    ids.push_back(e.get<int64_t>());
  } else if (e.is_array()) {
    for (const auto& x : e) {
      if (!x.is_number_integer()) return invalid_argument("eos_token_id list holds a non-integer");
      ids.push_back(x.get<int64_t>());
    }
  } else {
    return invalid_argument("eos_token_id must be an integer or a list of integers");
  }
  for (int64_t id : ids)
    if (id < 0 || id >= vocab_size)
      return invalid_argument("field 'eos_token_id' must be in [0, vocab_size " + std::to_string(vocab_size) +
                              "), got " + std::to_string(id));
  return ids;
}
}  // namespace

StatusOr<ModelConfig> parse_model_config(const json& config_in, const std::vector<std::string>& overrides) {
  if (!config_in.is_object()) return invalid_argument("not a JSON object");
  json config = config_in;
  NUCLEUS_RETURN_IF_ERROR(apply_overrides(&config, overrides));
  Reader r(config);
  ModelConfig c;
  NUCLEUS_RETURN_IF_ERROR(r.string_field("model_type", &c.model_type, true));
  // Kimi-K2 is DeepSeek-V3's architecture (DeepseekV3ForCausalLM) with its
  // own model_type; its config fields are V3's.
  if (c.model_type != "deepseek_v2" && c.model_type != "deepseek_v3" && c.model_type != "kimi_k2")
    return unsupported("model_type '" + c.model_type +
                       "' is not supported (supported: deepseek_v2, deepseek_v3, kimi_k2)");
  if (config.contains("architectures") && config["architectures"].is_array()) {
    for (const auto& a : config["architectures"]) {
      std::string arch = a.is_string() ? a.get<std::string>() : a.dump();
      if (arch != "DeepseekV2ForCausalLM" && arch != "DeepseekV3ForCausalLM")
        return unsupported("architecture '" + arch +
                           "' is not supported (supported: DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)");
    }
  }
  bool v3 = c.model_type == "deepseek_v3" || c.model_type == "kimi_k2";
  NUCLEUS_RETURN_IF_ERROR(r.int_field("vocab_size", &c.vocab_size, true, 1, kMaxVocab));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("hidden_size", &c.hidden_size, true, 1, kMaxWidth));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("intermediate_size", &c.intermediate_size, true, 1, kMaxWidth));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("num_hidden_layers", &c.num_hidden_layers, true, 1, kMaxCount));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("num_attention_heads", &c.num_attention_heads, true, 1, kMaxCount));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("q_lora_rank", &c.q_lora_rank, false, 1, kMaxWidth));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("kv_lora_rank", &c.kv_lora_rank, true, 1, kMaxWidth));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("qk_nope_head_dim", &c.qk_nope_head_dim, true, 1, kMaxWidth));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("qk_rope_head_dim", &c.qk_rope_head_dim, true, 2, kMaxWidth));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("v_head_dim", &c.v_head_dim, true, 1, kMaxWidth));
  NUCLEUS_RETURN_IF_ERROR(
      r.int_field("max_position_embeddings", &c.max_position_embeddings, true, 1, kMaxPositions));
  NUCLEUS_RETURN_IF_ERROR(r.double_field("rms_norm_eps", &c.rms_norm_eps, false));
  NUCLEUS_RETURN_IF_ERROR(require(c.rms_norm_eps > 0 && c.rms_norm_eps < 1, "rms_norm_eps", "in (0, 1)",
                                  c.rms_norm_eps));
  NUCLEUS_RETURN_IF_ERROR(r.double_field("rope_theta", &c.rope_theta, false));
  // The RoPE base: frequencies are theta^(-2i/d), and YaRN divides by ln(theta).
  NUCLEUS_RETURN_IF_ERROR(require(c.rope_theta > 1, "rope_theta", "> 1 (DeepSeek uses 10000)", c.rope_theta));
  NUCLEUS_RETURN_IF_ERROR(parse_torch_dtype(r, &c.torch_dtype));
  if (c.qk_rope_head_dim % 2 != 0)
    return invalid_argument("qk_rope_head_dim must be even, got " + std::to_string(c.qk_rope_head_dim));
  NUCLEUS_RETURN_IF_ERROR(parse_rope_scaling(config, &c.rope_scaling));

  NUCLEUS_RETURN_IF_ERROR(r.int_field("n_routed_experts", &c.n_routed_experts, false, 0, kMaxExperts));
  if (c.n_routed_experts > 0) {
    NUCLEUS_RETURN_IF_ERROR(r.int_field("moe_intermediate_size", &c.moe_intermediate_size, true, 1, kMaxWidth));
    NUCLEUS_RETURN_IF_ERROR(r.int_field("num_experts_per_tok", &c.num_experts_per_tok, true, 1, kMaxExperts));
    NUCLEUS_RETURN_IF_ERROR(r.int_field("n_shared_experts", &c.n_shared_experts, false, 0, kMaxCount));
    NUCLEUS_RETURN_IF_ERROR(r.int_field("n_group", &c.n_group, false, 1, kMaxExperts));
    NUCLEUS_RETURN_IF_ERROR(r.int_field("topk_group", &c.topk_group, false, 1, kMaxExperts));
    NUCLEUS_RETURN_IF_ERROR(r.int_field("first_k_dense_replace", &c.first_k_dense_replace, false, 0));
    NUCLEUS_RETURN_IF_ERROR(r.int_field("moe_layer_freq", &c.moe_layer_freq, false, 1));
    NUCLEUS_RETURN_IF_ERROR(r.bool_field("norm_topk_prob", &c.norm_topk_prob));
    NUCLEUS_RETURN_IF_ERROR(r.double_field("routed_scaling_factor", &c.routed_scaling_factor, false));
    NUCLEUS_RETURN_IF_ERROR(require(c.routed_scaling_factor > 0 && c.routed_scaling_factor <= kMaxScaling,
                                    "routed_scaling_factor", "in (0, 1e6]", c.routed_scaling_factor));
    std::string scoring = v3 ? "sigmoid" : "softmax";
    NUCLEUS_RETURN_IF_ERROR(r.string_field("scoring_func", &scoring, false));
    if (scoring == "softmax") c.scoring_func = ScoringFunc::kSoftmax;
    else if (scoring == "sigmoid") c.scoring_func = ScoringFunc::kSigmoid;
    else return unsupported("scoring_func '" + scoring + "' is not supported (supported: softmax, sigmoid)");
    std::string method = v3 ? "noaux_tc" : "greedy";
    NUCLEUS_RETURN_IF_ERROR(r.string_field("topk_method", &method, false));
    if (method == "greedy") c.topk_method = TopkMethod::kGreedy;
    else if (method == "group_limited_greedy") c.topk_method = TopkMethod::kGroupLimitedGreedy;
    else if (method == "noaux_tc") c.topk_method = TopkMethod::kNoauxTc;
    else
      return unsupported("topk_method '" + method +
                         "' is not supported (supported: greedy, group_limited_greedy, noaux_tc)");
    if (c.topk_method == TopkMethod::kNoauxTc && c.scoring_func != ScoringFunc::kSigmoid)
      return unsupported("topk_method noaux_tc needs scoring_func sigmoid, got " + scoring);
    if (c.n_routed_experts % c.n_group != 0)
      return invalid_argument("n_routed_experts " + std::to_string(c.n_routed_experts) +
                              " is not a multiple of n_group " + std::to_string(c.n_group));
    if (c.topk_group > c.n_group)
      return invalid_argument("topk_group " + std::to_string(c.topk_group) + " > n_group " +
                              std::to_string(c.n_group));
    if (c.num_experts_per_tok > c.n_routed_experts)
      return invalid_argument("num_experts_per_tok " + std::to_string(c.num_experts_per_tok) + " > n_routed_experts " +
                              std::to_string(c.n_routed_experts));
    if (c.topk_method != TopkMethod::kGreedy &&
        c.num_experts_per_tok > c.topk_group * (c.n_routed_experts / c.n_group))
      return invalid_argument("num_experts_per_tok exceeds the experts in topk_group groups");
  }

  if (config.contains("hidden_act") && config["hidden_act"] != "silu")
    return unsupported("hidden_act " + config["hidden_act"].dump() + " is not supported (supported: silu)");
  if (config.contains("attention_bias") && config["attention_bias"] == true)
    return unsupported("attention_bias true is not supported");
  NUCLEUS_RETURN_IF_ERROR(r.bool_field("tie_word_embeddings", &c.tie_word_embeddings));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("num_nextn_predict_layers", &c.num_nextn_predict_layers, false, 0, 16));
  NUCLEUS_RETURN_IF_ERROR(r.int_field("bos_token_id", &c.bos_token_id, false, 0, c.vocab_size - 1));
  NUCLEUS_ASSIGN_OR_RETURN(c.eos_token_ids, eos_token_ids_of(config, c.vocab_size));

  if (r.has("quantization_config")) {
    const json& q = config["quantization_config"];
    if (!q.is_object()) return invalid_argument("quantization_config must be an object");
    Reader qr(q, "quantization_config.");
    std::string method;
    NUCLEUS_RETURN_IF_ERROR(qr.string_field("quant_method", &method, true));
    if (method != "fp8")
      return unsupported("quantization_config.quant_method '" + method +
                         "' is not supported (supported: fp8)");
    std::string fmt = "e4m3";
    NUCLEUS_RETURN_IF_ERROR(qr.string_field("fmt", &fmt, false));
    if (fmt != "e4m3")
      return unsupported("quantization_config.fmt '" + fmt + "' is not supported (supported: e4m3)");
    std::string scheme = "dynamic";
    NUCLEUS_RETURN_IF_ERROR(qr.string_field("activation_scheme", &scheme, false));
    if (scheme != "dynamic")
      return unsupported("quantization_config.activation_scheme '" + scheme +
                         "' is not supported (supported: dynamic)");
    if (!q.contains("weight_block_size") || q["weight_block_size"].is_null())
      return unsupported("quantization_config has no weight_block_size (per-tensor FP8 is not supported; "
                         "block-scaled FP8 gives [n, k])");
    if (!q["weight_block_size"].is_array() || q["weight_block_size"].size() != 2 ||
        !q["weight_block_size"][0].is_number_integer() || !q["weight_block_size"][1].is_number_integer())
      return invalid_argument("quantization_config.weight_block_size must be two integers [n, k], got " +
                              q["weight_block_size"].dump());
    c.fp8 = true;
    c.weight_block_n = q["weight_block_size"][0].get<int64_t>();
    c.weight_block_k = q["weight_block_size"][1].get<int64_t>();
    if (c.weight_block_n <= 0 || c.weight_block_k <= 0 || c.weight_block_n > kMaxWidth || c.weight_block_k > kMaxWidth)
      return invalid_argument("quantization_config.weight_block_size must be in [1, " + std::to_string(kMaxWidth) +
                              "], got " + q["weight_block_size"].dump());
  }
  return c;
}

StatusOr<std::vector<int64_t>> load_generation_eos_token_ids(const std::string& path, int64_t vocab_size) {
  if (!std::filesystem::exists(path)) return std::vector<int64_t>{};
  NUCLEUS_ASSIGN_OR_RETURN(std::string text, read_regular_file(path));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument(path + ": not a JSON object");
  auto ids = eos_token_ids_of(j, vocab_size);
  if (!ids.ok()) return ids.status().with_context(path);
  return ids;
}

StatusOr<ModelConfig> load_model_config(const std::string& path, const std::vector<std::string>& overrides) {
  NUCLEUS_ASSIGN_OR_RETURN(std::string text, read_regular_file(path));  // a FIFO is refused, never read
  // No config.json field nests deeper than a few levels; deeper values are
  // dropped while parsing (never built, never copied: a recursive copy of a
  // 200,000-deep array overflowed the stack) and the file is refused.
  constexpr int kMaxDepth = 64;
  bool too_deep = false;
  const json::parser_callback_t depth_limit = [&](int depth, json::parse_event_t event, json&) {
    if (depth > kMaxDepth && (event == json::parse_event_t::object_start || event == json::parse_event_t::array_start))
      too_deep = true;
    return depth <= kMaxDepth;
  };
  json j = json::parse(text, depth_limit, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument(path + ": not valid JSON");
  if (too_deep) return invalid_argument(path + ": JSON nests deeper than " + std::to_string(kMaxDepth) + " levels");
  auto c = parse_model_config(j, overrides);
  if (!c.ok()) return c.status().with_context(path);
  return c;
}

}  // namespace nucleus
