// config.json parsing and the derived MLA softmax scale.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>

#include "io/hf_config.h"
#include "kernels/rope/rope_ref.h"
#include "model/deepseek/kernel_params.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

TEST(ConfigTest, SoftmaxScaleOfRealConfigs) {
  auto v3 = load_model_config(testing::model_path("configs/deepseek-v3.config.json"));
  ASSERT_TRUE(v3.ok()) << v3.status().to_string();
  EXPECT_NEAR(v3->softmax_scale(), 0.135234, 1e-6);
  auto v2 = load_model_config(testing::model_path("configs/deepseek-v2-lite.config.json"));
  ASSERT_TRUE(v2.ok()) << v2.status().to_string();
  EXPECT_NEAR(v2->softmax_scale(), 0.114721, 1e-6);
}

TEST(ConfigTest, RealConfigFields) {
  auto v3 = load_model_config(testing::model_path("configs/deepseek-v3.config.json"));
  ASSERT_TRUE(v3.ok());
  EXPECT_EQ(v3->q_lora_rank, 1536);
  EXPECT_TRUE(v3->fp8);
  EXPECT_EQ(v3->weight_block_n, 128);
  EXPECT_EQ(v3->topk_method, TopkMethod::kNoauxTc);
  EXPECT_EQ(v3->scoring_func, ScoringFunc::kSigmoid);
  EXPECT_FALSE(v3->is_moe_layer(2));
  EXPECT_TRUE(v3->is_moe_layer(3));
  auto v2 = load_model_config(testing::model_path("configs/deepseek-v2-lite.config.json"));
  ASSERT_TRUE(v2.ok());
  EXPECT_EQ(v2->q_lora_rank, 0);  // null
  EXPECT_FALSE(v2->fp8);
  EXPECT_EQ(v2->topk_method, TopkMethod::kGreedy);
  EXPECT_EQ(v2->scoring_func, ScoringFunc::kSoftmax);
  EXPECT_DOUBLE_EQ(v2->rope_scaling.mscale_all_dim, 0.707);
  EXPECT_EQ(v2->kv_cache_width(), 576);
}

// Kimi-K2 (moonshotai/Kimi-K2-Instruct-0905's config.json, the fields nucleus
// reads): DeepSeek-V3's architecture under model_type kimi_k2, 384 experts,
// 64 heads, YaRN with beta_fast == beta_slow == 1.
TEST(ConfigTest, KimiK2IsDeepSeekV3) {
  auto v3 = load_model_config(testing::model_path("configs/deepseek-v3.config.json"));
  ASSERT_TRUE(v3.ok());
  std::ifstream in(testing::model_path("configs/deepseek-v3.config.json"));
  json k = json::parse(in);
  k["model_type"] = "kimi_k2";
  k["n_routed_experts"] = 384;
  k["num_attention_heads"] = 64;
  k["num_key_value_heads"] = 64;
  k["n_group"] = 1;
  k["topk_group"] = 1;
  k["first_k_dense_replace"] = 1;
  k["routed_scaling_factor"] = 2.827;
  k["vocab_size"] = 163840;
  k["bos_token_id"] = 163584;
  k["eos_token_id"] = 163585;
  k["rope_theta"] = 50000.0;
  k["max_position_embeddings"] = 262144;
  k["num_nextn_predict_layers"] = 0;
  k["rope_scaling"] = {{"beta_fast", 1.0}, {"beta_slow", 1.0}, {"factor", 64.0}, {"mscale", 1.0},
                       {"mscale_all_dim", 1.0}, {"original_max_position_embeddings", 4096}, {"type", "yarn"}};
  auto c = parse_model_config(k);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->n_routed_experts, 384);
  EXPECT_EQ(c->topk_method, TopkMethod::kNoauxTc);
  EXPECT_EQ(c->scoring_func, ScoringFunc::kSigmoid);
  EXPECT_TRUE(c->fp8);
  EXPECT_FALSE(c->is_moe_layer(0));
  EXPECT_TRUE(c->is_moe_layer(1));
  // Equal betas: Hugging Face's ramp, a step at the correction dimension
  // (low == high gets high += 0.001): every frequency is either the
  // extrapolated or the interpolated one.
  const std::vector<float> inv = kernels::rope_inv_freq(rope_params(*c));
  const int64_t d = c->qk_rope_head_dim;
  int extrapolated = 0, interpolated = 0;
  for (int64_t i = 0; i < d / 2; ++i) {
    const double extra = 1.0 / std::pow(50000.0, 2.0 * i / d), inter = extra / 64.0;
    ASSERT_TRUE(std::isfinite(inv[i]));
    if (std::abs(inv[i] - extra) <= 1e-6 * extra) ++extrapolated;
    if (std::abs(inv[i] - inter) <= 1e-6 * inter) ++interpolated;
  }
  EXPECT_EQ(extrapolated + interpolated, d / 2);
  EXPECT_GT(extrapolated, 0);
  EXPECT_GT(interpolated, 0);
}

json tiny_config() {
  std::ifstream in(testing::model_path("tiny-dsv3/config.json"));
  return json::parse(in);
}

TEST(ConfigTest, RopeTypeKeySpelling) {
  json j = tiny_config();
  j["rope_scaling"].erase("type");
  j["rope_scaling"]["rope_type"] = "yarn";
  auto c = parse_model_config(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->rope_scaling.yarn);
}

// Both spellings present: rope_type decides, as in transformers
// (rope_scaling.get("rope_type", rope_scaling.get("type"))).
TEST(ConfigTest, RopeTypeWinsOverType) {
  json j = tiny_config();
  ASSERT_EQ(j["rope_scaling"]["type"], "yarn");
  j["rope_scaling"]["rope_type"] = "default";
  auto c = parse_model_config(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_FALSE(c->rope_scaling.yarn);
  j["rope_scaling"]["rope_type"] = "yarn";
  j["rope_scaling"]["type"] = "default";
  c = parse_model_config(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->rope_scaling.yarn);
}

// A config.json nesting deeper than 64 levels is refused (a 200,000-deep
// array overflowed the stack when the parsed value was copied).
TEST(ConfigTest, DeeplyNestedJsonIsRefused) {
  const std::string dir = testing::make_temp_dir("nucleus_config");
  std::ifstream in(testing::model_path("tiny-dsv3/config.json"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind('}');
  ASSERT_NE(close, std::string::npos);
  const std::string deep = ", \"x\": " + std::string(200000, '[') + std::string(200000, ']');
  std::ofstream(dir + "/config.json") << text.substr(0, close) << deep << "}";
  auto c = load_model_config(dir + "/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("nests deeper than 64 levels"), std::string::npos) << c.status().message();
  std::ofstream(dir + "/config.json") << text;  // the same file without it loads
  EXPECT_TRUE(load_model_config(dir + "/config.json").ok());
}

TEST(ConfigTest, ErrorsNameTheField) {
  struct Case {
    const char* key;
    json value;
    const char* expect;
  };
  std::vector<Case> cases = {
      {"model_type", "llama", "model_type 'llama'"},
      {"scoring_func", "relu", "scoring_func 'relu'"},
      {"topk_method", "random", "topk_method 'random'"},
      {"hidden_size", "big", "hidden_size"},
      {"hidden_act", "gelu", "hidden_act"},
  };
  for (const auto& c : cases) {
    json j = tiny_config();
    j[c.key] = c.value;
    auto r = parse_model_config(j);
    ASSERT_FALSE(r.ok()) << c.key;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
  }
  json j = tiny_config();
  j["rope_scaling"]["type"] = "longrope";
  auto r = parse_model_config(j);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("longrope"), std::string::npos);
  j = tiny_config();
  j["quantization_config"] = {{"quant_method", "awq"}};
  r = parse_model_config(j);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("awq"), std::string::npos);
}

TEST(ConfigTest, Overrides) {
  auto c = parse_model_config(tiny_config(), {"num_hidden_layers=2", "topk_method=\"greedy\""});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->num_hidden_layers, 2);
  auto bad = parse_model_config(tiny_config(), {"novalue"});
  EXPECT_FALSE(bad.ok());
}


// Values that load today but hang, crash or compute garbage later are refused
// at parse time, naming the field and the accepted range.
TEST(ConfigTest, ValuesOutOfRangeNameTheField) {
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::function<void(json&)> edit;
    std::string expect;  // the field, and the bound the message gives
  };
  auto set = [](const char* key, json v) { return [key, v](json& j) { j[key] = v; }; };
  auto rope = [](const char* key, json v) { return [key, v](json& j) { j["rope_scaling"][key] = v; }; };
  const std::vector<Case> cases = {
      {set("rope_theta", 0), "field 'rope_theta' must be > 1"},
      {set("rope_theta", -10000), "field 'rope_theta' must be > 1"},
      {set("rope_theta", 1), "field 'rope_theta' must be > 1"},
      {set("rope_theta", inf), "field 'rope_theta' must be a finite number, got inf"},
      {set("rms_norm_eps", 0), "field 'rms_norm_eps' must be in (0, 1)"},
      {set("rms_norm_eps", -1e-6), "field 'rms_norm_eps' must be in (0, 1)"},
      {set("rms_norm_eps", 1e30), "field 'rms_norm_eps' must be in (0, 1), got 1e+30"},
      {set("routed_scaling_factor", 0), "field 'routed_scaling_factor' must be in (0, 1e6]"},
      {set("routed_scaling_factor", -2.5), "field 'routed_scaling_factor' must be in (0, 1e6]"},
      {set("routed_scaling_factor", 1e308), "field 'routed_scaling_factor' must be in (0, 1e6], got 1e+308"},
      {set("routed_scaling_factor", inf), "field 'routed_scaling_factor' must be a finite number"},
      {rope("beta_fast", 0.5), "field 'rope_scaling.beta_fast' must be >= rope_scaling.beta_slow 1"},
      {rope("beta_slow", 0), "field 'rope_scaling.beta_slow' must be > 0"},
      {rope("factor", 0), "field 'rope_scaling.factor' must be in (0, 1e6]"},
      {rope("factor", -4), "field 'rope_scaling.factor' must be in (0, 1e6]"},
      {rope("mscale", inf), "field 'rope_scaling.mscale' must be a finite number, got inf"},
      {rope("mscale", -1), "field 'rope_scaling.mscale' must be >= 0"},
      {rope("mscale_all_dim", -0.5), "field 'rope_scaling.mscale_all_dim' must be >= 0"},
      {rope("original_max_position_embeddings", int64_t{1} << 40),
       "field 'rope_scaling.original_max_position_embeddings' must be in [1, 16777216]"},
      {set("max_position_embeddings", int64_t{1} << 62), "field 'max_position_embeddings' must be in [1, 16777216]"},
      {set("max_position_embeddings", int64_t{1} << 40), "field 'max_position_embeddings' must be in [1, 16777216]"},
      {set("max_position_embeddings", uint64_t{1} << 63), "field 'max_position_embeddings' must be in [1, 16777216]"},
      {set("max_position_embeddings", 0), "field 'max_position_embeddings' must be in [1, 16777216]"},
      {set("max_position_embeddings", 1e30), "field 'max_position_embeddings' must be an integer"},
      {set("hidden_size", 0), "field 'hidden_size' must be in [1, 1048576]"},
      {set("hidden_size", int64_t{1} << 40), "field 'hidden_size' must be in [1, 1048576]"},
      {set("num_hidden_layers", 0), "field 'num_hidden_layers' must be in [1, 4096]"},
      {set("num_attention_heads", -4), "field 'num_attention_heads' must be in [1, 4096]"},
      {set("vocab_size", 0), "field 'vocab_size' must be in [1, 16777216]"},
      {set("kv_lora_rank", 0), "field 'kv_lora_rank' must be in [1, 1048576]"},
      {set("moe_intermediate_size", 0), "field 'moe_intermediate_size' must be in [1, 1048576]"},
      {set("n_routed_experts", int64_t{1} << 20), "field 'n_routed_experts' must be in [0, 65536]"},
      {set("num_experts_per_tok", 0), "field 'num_experts_per_tok' must be in [1, 65536]"},
      {set("num_experts_per_tok", 9), "num_experts_per_tok 9 > n_routed_experts 8"},
      {set("topk_group", 5), "topk_group 5 > n_group 4"},
      {set("n_group", 3), "n_routed_experts 8 is not a multiple of n_group 3"},
      {set("bos_token_id", 4096), "field 'bos_token_id' must be in [0, 4095]"},
      {set("eos_token_id", 4096), "field 'eos_token_id' must be in [0, vocab_size 4096), got 4096"},
      {set("eos_token_id", json::array({1, -1})), "field 'eos_token_id' must be in [0, vocab_size 4096), got -1"},
      {set("torch_dtype", "int8"), "field 'torch_dtype' 'int8' is not supported (supported: bfloat16"},
  };
  for (const auto& c : cases) {
    json j = tiny_config();
    c.edit(j);
    auto r = parse_model_config(j);
    ASSERT_FALSE(r.ok()) << c.expect;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
    EXPECT_TRUE(r.status().code() == StatusCode::kInvalidArgument || r.status().code() == StatusCode::kUnsupported)
        << r.status().to_string();
  }
  // Bounds are inclusive where they say so: 2^24 positions load.
  json j = tiny_config();
  j["max_position_embeddings"] = int64_t{1} << 24;
  auto c = parse_model_config(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->max_position_embeddings, int64_t{1} << 24);
  EXPECT_EQ(c->torch_dtype, DType::kBF16);
  // The newer spelling of torch_dtype, and none at all.
  j = tiny_config();
  j.erase("torch_dtype");
  j["dtype"] = "float16";
  EXPECT_EQ(parse_model_config(j)->torch_dtype, DType::kF16);
  j.erase("dtype");
  EXPECT_FALSE(parse_model_config(j)->torch_dtype.has_value());
}

// The CPU reference keeps a bounded cos/sin table (2^16 positions in the
// model); a position past the table is computed to the same f32 values.
TEST(ConfigTest, RopePastTheTableEqualsTheTable) {
  auto config = parse_model_config(tiny_config());
  ASSERT_TRUE(config.ok());
  const kernels::RopeTable small = kernels::make_rope_table(rope_params(*config), 16);
  const kernels::RopeTable large = kernels::make_rope_table(rope_params(*config), 1024);
  for (int64_t pos : {int64_t{15}, int64_t{16}, int64_t{17}, int64_t{300}, int64_t{1023}}) {
    std::vector<float> a(64), b(64);
    for (int i = 0; i < 64; ++i) a[i] = b[i] = 0.25f * static_cast<float>(i % 7) - 0.6f;
    kernels::apply_rope_interleaved_ref(small, pos, a.data());
    kernels::apply_rope_interleaved_ref(large, pos, b.data());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), 64 * sizeof(float)), 0) << "position " << pos;
    EXPECT_NE(a[3], 0.25f * 3 - 0.6f) << "position " << pos;  // rotated
  }
}

}  // namespace
}  // namespace nucleus
