// Tensor-parallel sharding at load: every tensor kind of a rank's shard is
// exactly its slice of the TP = 1 weights (heads of q_b/kv_b as rows, o_proj's
// columns, the MLP/expert intermediate slices, the vocabulary rows of the
// embedding and lm_head, the rest replicated), for bf16 and FP8 checkpoints
// (FP8 scales sliced with their weights), and the refusals: a config that
// does not divide, and an FP8 shard boundary inside a 128-block.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/dtype.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/tp_shard.h"
#include "model/weights.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

StatusOr<ModelWeights> load(const std::string& dir, const TpShard& shard) {
  auto config = load_model_config(dir + "/config.json");
  if (!config.ok()) return config.status();
  auto ckpt = Checkpoint::open(dir);
  if (!ckpt.ok()) return ckpt.status();
  auto backend = make_cpu_weight_backend();
  LoadOptions options;
  options.show_progress = false;
  return load_weights(*ckpt, *config, *backend, options, shard);
}

// Expects `part` ([rows, cols] f32) to equal rows or columns [begin, end) of
// `full` (or all of it), reporting the first mismatching coordinate.
void expect_slice(const Tensor& full, const Tensor& part, ShardSplit split, int64_t begin, int64_t end,
                  const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(full.dtype(), DType::kF32);
  ASSERT_EQ(part.dtype(), DType::kF32);
  const int64_t rows = full.rank() == 1 ? 1 : full.dim(0), cols = full.rank() == 1 ? full.dim(0) : full.dim(1);
  int64_t r0 = 0, r1 = rows, c0 = 0, c1 = cols;
  if (split == ShardSplit::kRows) r0 = begin, r1 = end;
  if (split == ShardSplit::kCols) c0 = begin, c1 = end;
  ASSERT_EQ(part.numel(), (r1 - r0) * (c1 - c0));
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      const float want = full.data<float>()[r * cols + c];
      const float got = part.data<float>()[(r - r0) * (c1 - c0) + (c - c0)];
      if (want != got) {
        ADD_FAILURE() << "first mismatch at full [" << r << ", " << c << "]: " << got << " vs " << want;
        return;
      }
    }
}

// gate_up is [gate rows; up rows]: a rank's is [its gate slice; its up slice].
void expect_mlp(const MlpWeights& full, const MlpWeights& part, const TpShard& s, const std::string& what) {
  const int64_t inter = full.inter, local = inter / s.world_size, b = s.rank * local;
  EXPECT_EQ(part.inter, local) << what;
  const int64_t hidden = full.gate_up.in_features;
  Tensor gate = part.gate_up.weight.rows(0, local), up = part.gate_up.weight.rows(local, local);
  expect_slice(full.gate_up.weight.rows(0, inter), gate, ShardSplit::kRows, b, b + local, what + ".gate_proj");
  expect_slice(full.gate_up.weight.rows(inter, inter), up, ShardSplit::kRows, b, b + local, what + ".up_proj");
  EXPECT_EQ(part.gate_up.out_features, 2 * local);
  EXPECT_EQ(part.gate_up.in_features, hidden);
  expect_slice(full.down.weight, part.down.weight, ShardSplit::kCols, b, b + local, what + ".down_proj");
}

// Every tensor of rank s.rank's shard against the TP = 1 weights.
void expect_shard(const ModelWeights& full, const ModelWeights& part, const ModelConfig& c, const TpShard& s) {
  const int n = s.world_size, r = s.rank;
  const int64_t V = c.vocab_size, heads = c.num_attention_heads / n;
  auto rows = [&](int64_t per) { return std::pair<int64_t, int64_t>{r * per, (r + 1) * per}; };
  auto [v0, v1] = rows(V / n);
  expect_slice(full.embed_tokens, part.embed_tokens, ShardSplit::kRows, v0, v1, "embed_tokens (vocabulary rows)");
  expect_slice(full.lm_head.weight, part.lm_head.weight, ShardSplit::kRows, v0, v1, "lm_head (vocabulary rows)");
  expect_slice(full.norm, part.norm, ShardSplit::kReplicated, 0, 0, "norm");
  ASSERT_EQ(part.layers.size(), full.layers.size());
  for (size_t l = 0; l < full.layers.size(); ++l) {
    const LayerWeights &F = full.layers[l], &P = part.layers[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    expect_slice(F.input_layernorm, P.input_layernorm, ShardSplit::kReplicated, 0, 0, p + "input_layernorm");
    expect_slice(F.post_attention_layernorm, P.post_attention_layernorm, ShardSplit::kReplicated, 0, 0,
                 p + "post_attention_layernorm");
    const AttentionWeights &Fa = F.attn, &Pa = P.attn;
    if (Fa.q_a_proj) {
      expect_slice(Fa.q_a_proj->weight, Pa.q_a_proj->weight, ShardSplit::kReplicated, 0, 0, p + "q_a_proj");
      expect_slice(Fa.q_a_layernorm, Pa.q_a_layernorm, ShardSplit::kReplicated, 0, 0, p + "q_a_layernorm");
      auto [q0, q1] = rows(heads * c.qk_head_dim());
      expect_slice(Fa.q_b_proj->weight, Pa.q_b_proj->weight, ShardSplit::kRows, q0, q1, p + "q_b_proj (heads)");
    } else {
      auto [q0, q1] = rows(heads * c.qk_head_dim());
      expect_slice(Fa.q_proj->weight, Pa.q_proj->weight, ShardSplit::kRows, q0, q1, p + "q_proj (heads)");
    }
    expect_slice(Fa.kv_a_proj.weight, Pa.kv_a_proj.weight, ShardSplit::kReplicated, 0, 0, p + "kv_a_proj_with_mqa");
    expect_slice(Fa.kv_a_layernorm, Pa.kv_a_layernorm, ShardSplit::kReplicated, 0, 0, p + "kv_a_layernorm");
    auto [k0, k1] = rows(heads * (c.qk_nope_head_dim + c.v_head_dim));
    expect_slice(Fa.kv_b_proj.weight, Pa.kv_b_proj.weight, ShardSplit::kRows, k0, k1, p + "kv_b_proj (heads)");
    auto [o0, o1] = rows(heads * c.v_head_dim);
    expect_slice(Fa.o_proj.weight, Pa.o_proj.weight, ShardSplit::kCols, o0, o1, p + "o_proj (heads' columns)");
    if (F.mlp) expect_mlp(*F.mlp, *P.mlp, s, p + "mlp");
    if (F.moe) {
      expect_slice(F.moe->router.weight, P.moe->router.weight, ShardSplit::kReplicated, 0, 0, p + "mlp.gate");
      if (F.moe->e_score_correction_bias.defined())
        expect_slice(F.moe->e_score_correction_bias, P.moe->e_score_correction_bias, ShardSplit::kReplicated, 0, 0,
                     p + "e_score_correction_bias");
      ASSERT_EQ(P.moe->experts.size(), F.moe->experts.size());
      for (size_t e = 0; e < F.moe->experts.size(); ++e)
        expect_mlp(F.moe->experts[e], P.moe->experts[e], s, p + "mlp.experts." + std::to_string(e));
      ASSERT_EQ(P.moe->shared.has_value(), F.moe->shared.has_value());
      if (F.moe->shared) expect_mlp(*F.moe->shared, *P.moe->shared, s, p + "mlp.shared_experts");
      // One shared expert loaded as a routed-expert-shaped piece is the whole MLP.
      ASSERT_EQ(P.moe->shared_experts.size(), F.moe->shared_experts.size());
      if (F.moe->shared_experts.size() == 1)
        expect_mlp(F.moe->shared_experts[0], P.moe->shared_experts[0], s, p + "mlp.shared_experts");
    }
  }
}

TEST(TpShardTest, EveryTensorKindOfTinyDsv3IsItsSlice) {
  const std::string dir = testing::model_path("tiny-dsv3");
  auto config = load_model_config(dir + "/config.json");
  ASSERT_TRUE(config.ok());
  auto full = load(dir, {});
  ASSERT_TRUE(full.ok()) << full.status().to_string();
  for (int n : {2, 4})
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(n));
      auto part = load(dir, {r, n});
      ASSERT_TRUE(part.ok()) << part.status().to_string();
      expect_shard(*full, *part, *config, {r, n});
    }
}

// ---------------------------------------------------------------- a synthetic FP8 checkpoint

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A small DeepSeek-V3 checkpoint whose linear weights are random FP8 with a
// different random scale in every 128x128 block, so a scale sliced one block
// off changes the dequantized values. 2 layers (dense, MoE with 2 experts and
// a shared one), 4 heads, widths that split in two on block boundaries.
std::string write_fp8_model() {
  const std::string dir = testing::make_temp_dir("nucleus_tp_fp8_");
  std::ifstream in(testing::model_path("tiny-dsv3-fp8/config.json"));
  json cfg = json::parse(in);
  cfg["num_hidden_layers"] = 2;
  cfg["first_k_dense_replace"] = 1;
  cfg["vocab_size"] = 256;
  cfg["intermediate_size"] = 512;
  cfg["moe_intermediate_size"] = 256;
  cfg["n_routed_experts"] = 2;
  cfg["num_experts_per_tok"] = 1;
  cfg["n_group"] = 1;
  cfg["topk_group"] = 1;
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  const int64_t H = 256, V = 256, nh = 4, ql = 128, kvl = 512, I = 512, MI = 256;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> val(-2.0f, 2.0f), scale(0.005f, 0.02f);
  json header = json::object();
  std::string data;
  auto add = [&](const std::string& name, const char* dtype, std::vector<int64_t> shape, const std::string& bytes) {
    header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data += bytes;
  };
  auto bf16 = [&](const std::string& name, std::vector<int64_t> shape, bool ones = false) {
    std::string b(shape_numel(shape) * 2, '\0');
    for (int64_t i = 0; i < shape_numel(shape); ++i) {
      const uint16_t h = f32_to_bf16(ones ? 1.0f + 0.01f * val(rng) : 0.05f * val(rng));
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
    add(name, "BF16", shape, b);
  };
  auto fp8 = [&](const std::string& prefix, int64_t n, int64_t k) {
    std::string q(n * k, '\0');
    for (auto& ch : q) ch = static_cast<char>(f32_to_fp8e4m3(val(rng)));
    add(prefix + ".weight", "F8_E4M3", {n, k}, q);
    const int64_t sn = (n + 127) / 128, sk = (k + 127) / 128;
    std::string s(sn * sk * 4, '\0');
    for (int64_t i = 0; i < sn * sk; ++i) {
      const float f = scale(rng);
      std::memcpy(s.data() + 4 * i, &f, 4);
    }
    add(prefix + ".weight_scale_inv", "F32", {sn, sk}, s);
  };
  auto mlp = [&](const std::string& p, int64_t inter) {
    fp8(p + ".gate_proj", inter, H);
    fp8(p + ".up_proj", inter, H);
    fp8(p + ".down_proj", H, inter);
  };
  bf16("model.embed_tokens.weight", {V, H});
  bf16("lm_head.weight", {V, H});
  bf16("model.norm.weight", {H}, true);
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    bf16(p + "input_layernorm.weight", {H}, true);
    bf16(p + "post_attention_layernorm.weight", {H}, true);
    fp8(p + "self_attn.q_a_proj", ql, H);
    bf16(p + "self_attn.q_a_layernorm.weight", {ql}, true);
    fp8(p + "self_attn.q_b_proj", nh * 192, ql);
    fp8(p + "self_attn.kv_a_proj_with_mqa", kvl + 64, H);
    bf16(p + "self_attn.kv_a_layernorm.weight", {kvl}, true);
    fp8(p + "self_attn.kv_b_proj", nh * 256, kvl);
    fp8(p + "self_attn.o_proj", H, nh * 128);
    if (l == 0) {
      mlp(p + "mlp", I);
    } else {
      bf16(p + "mlp.gate.weight", {2, H});
      std::string bias(8, '\0');
      const float b[2] = {0.1f, -0.1f};
      std::memcpy(bias.data(), b, 8);
      add(p + "mlp.gate.e_score_correction_bias", "F32", {2}, bias);
      mlp(p + "mlp.experts.0", MI);
      mlp(p + "mlp.experts.1", MI);
      mlp(p + "mlp.shared_experts", MI);
    }
  }
  const std::string text = header.dump();
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  out << le64(text.size()) << text << data;
  return dir;
}

TEST(TpShardTest, Fp8WeightsAndTheirBlockScalesAreSlicedTogether) {
  const std::string dir = write_fp8_model();
  auto config = load_model_config(dir + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  ASSERT_TRUE(config->fp8);
  auto full = load(dir, {});
  ASSERT_TRUE(full.ok()) << full.status().to_string();
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of 2");
    auto part = load(dir, {r, 2});
    ASSERT_TRUE(part.ok()) << part.status().to_string();
    expect_shard(*full, *part, *config, {r, 2});
  }
  // At 4 ranks q_b_proj's 768 rows split at 192, inside block [128, 256).
  auto four = load(dir, {1, 4});
  ASSERT_FALSE(four.ok());
  const std::string m = four.status().message();
  EXPECT_NE(m.find("model.layers.0.self_attn.q_b_proj.weight"), std::string::npos) << m;
  EXPECT_NE(m.find("at 192, inside a 128-wide block"), std::string::npos) << m;
  EXPECT_NE(m.find("whole blocks here: 1, 2, 3, 6"), std::string::npos) << m;
}

TEST(TpShardTest, TinyFp8ExpertsRefuseABoundaryInsideABlock) {
  // moe_intermediate_size 192 splits at 96, inside the first 128-block of
  // every expert's gate_proj; the first expert of the first MoE layer is named.
  auto w = load(testing::model_path("tiny-dsv3-fp8"), {0, 2});
  ASSERT_FALSE(w.ok());
  const std::string m = w.status().message();
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.find("model.layers.1.mlp.experts.0.gate_proj.weight: --tensor-parallel-size 2 splits its 192 rows "
                   "at 96, inside a 128-wide block of its FP8 weight_scale_inv"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("whole blocks here: 1)"), std::string::npos) << m;
}

TEST(TpShardTest, SliceBlockScaleByHand) {
  // scale [3, 2] of a [384, 256] weight: rows split in 3 at 128 and 256.
  Tensor scale = Tensor::from_f32({3, 2}, {1, 2, 3, 4, 5, 6});
  auto mid = slice_block_scale(scale, ShardSplit::kRows, 128, 256, 384, 128, 3, "w");
  ASSERT_TRUE(mid.ok());
  EXPECT_EQ(mid->shape(), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(mid->data<float>()[0], 3);
  EXPECT_EQ(mid->data<float>()[1], 4);
  auto cols = slice_block_scale(scale, ShardSplit::kCols, 128, 256, 256, 128, 2, "w");
  ASSERT_TRUE(cols.ok());
  EXPECT_EQ(cols->shape(), (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(cols->data<float>()[2], 6);
  // A boundary inside a block, and the dimension's ragged end accepted.
  auto bad = slice_block_scale(scale, ShardSplit::kCols, 64, 128, 256, 128, 4, "model.x.weight");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("splits its 256 columns at 64, inside a 128-wide block"), std::string::npos)
      << bad.status().to_string();
  Tensor ragged = Tensor::from_f32({2, 1}, {7, 8});  // a [192, k] weight: blocks [0,128) and [128,192)
  auto tail = slice_block_scale(ragged, ShardSplit::kRows, 128, 192, 192, 128, 1, "w");
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(tail->data<float>()[0], 8);
}

TEST(TpShardTest, SliceHostCopiesRowsAndColumnsOfAnyDtype) {
  Tensor t = Tensor::empty({3, 4}, DType::kBF16);
  for (int i = 0; i < 12; ++i) t.data<uint16_t>()[i] = static_cast<uint16_t>(i);
  Tensor r = slice_host(t, ShardSplit::kRows, 1, 3);
  EXPECT_EQ(r.shape(), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(r.data<uint16_t>()[0], 4);
  EXPECT_EQ(r.data<uint16_t>()[7], 11);
  Tensor c = slice_host(t, ShardSplit::kCols, 2, 4);
  EXPECT_EQ(c.shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(c.data<uint16_t>()[0], 2);
  EXPECT_EQ(c.data<uint16_t>()[1], 3);
  EXPECT_EQ(c.data<uint16_t>()[2], 6);
  EXPECT_EQ(c.data<uint16_t>()[5], 11);
}

TEST(TpShardTest, ConfigThatDoesNotDivideNamesTheFieldAndTheSizesThatWork) {
  auto config = load_model_config(testing::model_path("tiny-dsv3/config.json"));
  ASSERT_TRUE(config.ok());
  EXPECT_TRUE(check_tp_config(*config, 4).ok());
  Status s = check_tp_config(*config, 3);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("num_attention_heads 4 is not divisible by --tensor-parallel-size 3"), std::string::npos)
      << s.to_string();
  EXPECT_NE(s.message().find("(sizes that divide every split dimension of this model: 1, 2, 4)"), std::string::npos)
      << s.to_string();
  config->num_attention_heads = 8;
  Status inter = check_tp_config(*config, 8);  // moe_intermediate_size 192 = 8 * 24 divides; vocab too; dense 768 too
  EXPECT_TRUE(inter.ok()) << inter.to_string();
  config->moe_intermediate_size = 100;
  Status moe = check_tp_config(*config, 8);
  EXPECT_NE(moe.message().find("moe_intermediate_size 100 is not divisible"), std::string::npos) << moe.to_string();
}

TEST(TpShardTest, DummyShardsAreSlicesOfTheWholeDummyModel) {
  auto config = load_model_config(testing::model_path("tiny-dsv3/config.json"));
  ASSERT_TRUE(config.ok());
  auto backend = make_cpu_weight_backend();
  auto full = make_dummy_weights(*config, *backend, 3);
  ASSERT_TRUE(full.ok());
  for (int r = 0; r < 2; ++r) {
    auto part = make_dummy_weights(*config, *backend, 3, {r, 2});
    ASSERT_TRUE(part.ok()) << part.status().to_string();
    expect_shard(*full, *part, *config, {r, 2});
  }
}

// NUCLEUS_MOE_FUSE_SHARED: two shared experts (width 2 x 192) load as two
// routed-expert-shaped pieces; at TP t rank r's piece s holds intermediate
// units [u, u + I_r) of the whole shared MLP, u = (2 r + s) I_r, I_r = 192 / t:
// gate and up rows, down columns of the MLP loaded whole (=0).
TEST(TpShardTest, SharedExpertPiecesAreSlicesOfTheWholeSharedMlp) {
  auto config = load_model_config(testing::model_path("tiny-dsv3/config.json"), {"n_shared_experts=2"});
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  auto backend = make_cpu_weight_backend();
  auto with = [&](const char* v, const TpShard& shard) {
    setenv("NUCLEUS_MOE_FUSE_SHARED", v, 1);
    auto w = make_dummy_weights(*config, *backend, 5, shard);
    unsetenv("NUCLEUS_MOE_FUSE_SHARED");
    return w;
  };
  auto whole = with("0", {});
  ASSERT_TRUE(whole.ok()) << whole.status().to_string();
  const int64_t F = 2 * config->moe_intermediate_size;
  for (int t : {1, 2}) {
    for (int r = 0; r < t; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(t));
      auto pieces = with("1", {r, t});
      ASSERT_TRUE(pieces.ok()) << pieces.status().to_string();
      const int64_t I_r = config->moe_intermediate_size / t;
      for (size_t l = 0; l < whole->layers.size(); ++l) {
        if (!whole->layers[l].moe) continue;
        const MoeWeights& W = *whole->layers[l].moe;
        const MoeWeights& P = *pieces->layers[l].moe;
        ASSERT_TRUE(W.shared && W.shared_experts.empty());
        ASSERT_FALSE(P.shared);
        ASSERT_EQ(P.shared_experts.size(), 2u);
        for (int64_t piece = 0; piece < 2; ++piece) {
          const MlpWeights& m = P.shared_experts[piece];
          const int64_t u = (2 * r + piece) * I_r;
          EXPECT_EQ(m.inter, I_r);
          expect_slice(W.shared->gate_up.weight, slice_host(m.gate_up.weight, ShardSplit::kRows, 0, I_r),
                       ShardSplit::kRows, u, u + I_r, "gate rows of piece " + std::to_string(piece));
          expect_slice(W.shared->gate_up.weight, slice_host(m.gate_up.weight, ShardSplit::kRows, I_r, 2 * I_r),
                       ShardSplit::kRows, F + u, F + u + I_r, "up rows of piece " + std::to_string(piece));
          expect_slice(W.shared->down.weight, m.down.weight, ShardSplit::kCols, u, u + I_r,
                       "down columns of piece " + std::to_string(piece));
        }
      }
    }
  }
}

}  // namespace
}  // namespace nucleus
