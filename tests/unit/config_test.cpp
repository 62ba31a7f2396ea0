// config.json parsing and the derived MLA softmax scale.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "io/hf_config.h"
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

}  // namespace
}  // namespace nucleus
