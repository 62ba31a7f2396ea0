// The MTP module (DeepSeek-V3's multi-token prediction) on the CPU reference
// against the PyTorch reference of tools/train_tiny_mtp.py (mtp.safetensors
// at testing::mtp_reference_path(); design.md "Speculative decoding (MTP)"): draft
// logits and the MTP's own hidden state at every prompt row, argmax and
// top-8 logits at every row of prompt + greedy output; the same rows computed
// in two chunks (the MTP's own paged cache) agree with one pass; the same at
// tensor-parallel size 2 (ranks on threads). Also the loader: embed_tokens
// and shared_head.head deduplicated (each rank's shards too), a rank's
// shard of the module, and the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/weights.h"
#include "runtime/model_executor.h"
#include "test_util.h"

namespace nucleus {
namespace {

constexpr int64_t kBlock = 16;

struct Ref {
  std::shared_ptr<SafetensorsFile> file;
  Tensor get(const std::string& name) const {
    auto it = file->tensors().find(name);
    NUCLEUS_CHECK(it != file->tensors().end(), "reference tensor {} missing", name);
    const TensorEntry& e = it->second;
    Tensor t = Tensor::empty(e.shape, e.dtype);
    std::memcpy(t.raw(), e.data, e.nbytes);
    return t;
  }
  bool has(const std::string& name) const { return file->tensors().count(name) != 0; }
};

Ref load_ref() {
  auto f = SafetensorsFile::open(testing::mtp_reference_path());
  NUCLEUS_CHECK(f.ok(), "{}", f.status().to_string());
  return {*f};
}

std::unique_ptr<ModelExecutor> load_mtp_model(const std::string& name, int tp = 1) {
  ModelOptions o;
  o.load_mtp = true;
  o.tensor_parallel_size = tp;
  auto m = load_deepseek_model(testing::mtp_dir() + "/" + name, o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// One sequence's rows [begin, end) with the given tokens at positions begin..,
// cached rows [0, begin) in blocks 0, 1, ...; logits at every row.
StepInputs one_seq(const std::vector<int32_t>& tokens, int64_t begin, int64_t num_blocks) {
  StepInputs in;
  in.query_start = {0, static_cast<int32_t>(tokens.size())};
  in.context_lens = {static_cast<int32_t>(begin)};
  in.max_blocks_per_seq = static_cast<int32_t>(num_blocks);
  for (int32_t b = 0; b < num_blocks; ++b) in.block_tables.push_back(b);
  for (size_t i = 0; i < tokens.size(); ++i) {
    in.token_ids.push_back(tokens[i]);
    in.positions.push_back(static_cast<int32_t>(begin + i));
    in.slot_mapping.push_back(begin + static_cast<int64_t>(i));
    in.logit_indices.push_back(static_cast<int32_t>(i));
  }
  return in;
}

struct MtpRun {
  Tensor logits;  // [L - 1, vocab]
  Tensor hidden;  // [L - 1, hidden] (pre-norm y_i)
};

// The target over all of `tokens`, then the MTP rows 0..L-2 (token t_{i+1},
// hidden h_i, position i) in chunks starting at `splits`.
MtpRun run_mtp(ModelExecutor& m, const std::vector<int32_t>& tokens, std::vector<int64_t> splits) {
  const int64_t L = static_cast<int64_t>(tokens.size()), H = m.config().hidden_size;
  const int64_t nb = (L + kBlock - 1) / kBlock;
  KvCache kv = m.make_kv_cache(nb, kBlock), mkv = m.make_mtp_kv_cache(nb, kBlock);
  StepInputs in = one_seq(tokens, 0, nb);
  auto logits = m.forward(in, kv);
  NUCLEUS_CHECK(logits.ok(), "{}", logits.status().to_string());
  auto h = m.hidden_states();
  NUCLEUS_CHECK(h.ok(), "{}", h.status().to_string());
  Tensor hidden = h->clone();
  MtpRun out;
  out.logits = Tensor::empty({L - 1, m.config().vocab_size}, DType::kF32);
  out.hidden = Tensor::empty({L - 1, H}, DType::kF32);
  splits.push_back(L - 1);
  int64_t begin = 0;
  for (int64_t end : splits) {
    std::vector<int32_t> next(tokens.begin() + begin + 1, tokens.begin() + end + 1);
    StepInputs mi = one_seq(next, begin, nb);
    mi.mtp_hidden = hidden.rows(begin, end - begin).clone();
    auto ml = m.mtp_forward(mi, mkv);
    NUCLEUS_CHECK(ml.ok(), "{}", ml.status().to_string());
    std::memcpy(out.logits.rows(begin, end - begin).raw(), ml->raw(), ml->nbytes());
    auto y = m.mtp_hidden_states();
    NUCLEUS_CHECK(y.ok(), "{}", y.status().to_string());
    std::memcpy(out.hidden.rows(begin, end - begin).raw(), y->raw(), y->nbytes());
    begin = end;
  }
  return out;
}

double max_abs_diff(const float* a, const float* b, int64_t n) {
  double d = 0;
  for (int64_t i = 0; i < n; ++i) d = std::max(d, static_cast<double>(std::fabs(a[i] - b[i])));
  return d;
}

void check_model(const std::string& name, int num_prompts, int tp = 1) {
  const Ref ref = load_ref();
  auto m = load_mtp_model(name, tp);
  ASSERT_TRUE(m->has_mtp());
  ASSERT_EQ(m->tensor_parallel_size(), tp);
  const int64_t V = m->config().vocab_size, H = m->config().hidden_size;
  for (int p = 0; p < num_prompts; ++p) {
    const std::string key = name + ".prompt" + std::to_string(p) + ".";
    Tensor tok = ref.get(key + "tokens");
    std::vector<int32_t> tokens(tok.data<int32_t>(), tok.data<int32_t>() + tok.numel());
    const int64_t L = static_cast<int64_t>(tokens.size());
    MtpRun r = run_mtp(*m, tokens, {});
    // Argmax at every row where the reference's top-2 margin is not a near tie.
    Tensor argmax = ref.get(key + "draft_argmax"), topk_ids = ref.get(key + "draft_topk_ids"),
           topk = ref.get(key + "draft_topk_logits");
    int compared = 0;
    double topk_err = 0;
    for (int64_t i = 0; i < L - 1; ++i) {
      const float* row = r.logits.data<float>() + i * V;
      for (int k = 0; k < 8; ++k)
        topk_err = std::max(topk_err, static_cast<double>(std::fabs(row[topk_ids.data<int32_t>()[i * 8 + k]] -
                                                                    topk.data<float>()[i * 8 + k])));
      if (topk.data<float>()[i * 8] - topk.data<float>()[i * 8 + 1] < 1e-3f) continue;
      const int64_t best = std::max_element(row, row + V) - row;
      EXPECT_EQ(best, argmax.data<int32_t>()[i]) << key << " row " << i;
      ++compared;
    }
    EXPECT_GT(compared, (L - 1) / 2) << key;
    EXPECT_LT(topk_err, 1e-3) << key << " top-8 logits";
    if (ref.has(key + "draft_logits")) {
      Tensor dl = ref.get(key + "draft_logits"), dh = ref.get(key + "draft_hidden");
      const int64_t rows = dl.dim(0);
      const double le = max_abs_diff(r.logits.data<float>(), dl.data<float>(), rows * V);
      const double he = max_abs_diff(r.hidden.data<float>(), dh.data<float>(), rows * H);
      EXPECT_LT(le, 1e-3) << key << " draft logits over the prompt's " << rows << " rows";
      EXPECT_LT(he, 1e-3) << key << " draft hidden states";
      std::printf("%s (TP %d): %lld prompt rows, max |draft logit - ref| %.3g, max |hidden - ref| %.3g, top-8 %.3g\n",
                  key.c_str(), tp, static_cast<long long>(rows), le, he, topk_err);
    }
    // Chunked: the MTP's cache serves the later chunks' attention.
    MtpRun c = run_mtp(*m, tokens, {5, std::min<int64_t>(L - 2, 21)});
    EXPECT_LT(max_abs_diff(c.logits.data<float>(), r.logits.data<float>(), (L - 1) * V), 1e-4) << key << " chunked";
  }
}

TEST(MtpReference, Bf16MatchesPytorch) { check_model("tiny-dsv3", 8); }
TEST(MtpReference, Fp8MatchesPytorch) { check_model("tiny-dsv3-fp8", 4); }
// Every rank runs its shard of the module (tiny-dsv3-fp8's 192-wide experts
// do not split into whole 128-blocks, so only bf16 runs at TP = 2).
TEST(MtpReference, Bf16MatchesPytorchAtTp2) { check_model("tiny-dsv3", 4, 2); }

TEST(MtpLoad, SharedTensorsAreOneCopy) {
  auto config = load_model_config(testing::mtp_dir() + "/tiny-dsv3/config.json");
  ASSERT_TRUE(config.ok());
  auto ckpt = Checkpoint::open(testing::mtp_dir() + "/tiny-dsv3");
  ASSERT_TRUE(ckpt.ok());
  auto backend = make_cpu_weight_backend();
  LoadOptions lo;
  lo.show_progress = false;
  lo.load_mtp = true;
  auto w = load_weights(*ckpt, *config, *backend, lo);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_TRUE(w->mtp);
  EXPECT_EQ(w->mtp->embed_tokens.raw(), w->embed_tokens.raw());
  EXPECT_EQ(w->mtp->lm_head.weight.raw(), w->lm_head.weight.raw());
  ASSERT_EQ(w->mtp->layers.size(), 1u);
  EXPECT_TRUE(w->mtp->layers[0].moe.has_value());
  // Without load_mtp the MTP tensors are skipped (as before).
  lo.load_mtp = false;
  auto plain = load_weights(*ckpt, *config, *backend, lo);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  EXPECT_FALSE(plain->mtp);
}

// Rank r of 2: the module's decoder layer split as any layer's (half the
// heads, half of every expert's and the shared expert's width), its
// embedding and head the main model's vocabulary shards (one copy), the
// front (enorm, hnorm, eh_proj) and shared_head.norm whole.
TEST(MtpLoad, TensorParallelRankShard) {
  auto config = load_model_config(testing::mtp_dir() + "/tiny-dsv3/config.json");
  ASSERT_TRUE(config.ok());
  auto ckpt = Checkpoint::open(testing::mtp_dir() + "/tiny-dsv3");
  ASSERT_TRUE(ckpt.ok());
  auto backend = make_cpu_weight_backend();
  LoadOptions lo;
  lo.show_progress = false;
  lo.load_mtp = true;
  const ModelConfig& c = *config;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    auto w = load_weights(*ckpt, c, *backend, lo, TpShard{r, 2});
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    ASSERT_TRUE(w->mtp);
    const ModelWeights& m = *w->mtp;
    EXPECT_EQ(m.embed_tokens.raw(), w->embed_tokens.raw());
    EXPECT_EQ(m.lm_head.weight.raw(), w->lm_head.weight.raw());
    EXPECT_EQ(m.embed_tokens.shape(), (std::vector<int64_t>{V / 2, H}));
    EXPECT_EQ(m.lm_head.weight.shape(), (std::vector<int64_t>{V / 2, H}));
    ASSERT_TRUE(m.mtp_front);
    EXPECT_EQ(m.mtp_front->eh_proj.weight.shape(), (std::vector<int64_t>{H, 2 * H}));
    EXPECT_EQ(m.mtp_front->enorm.numel(), H);
    EXPECT_EQ(m.norm.numel(), H);
    ASSERT_EQ(m.layers.size(), 1u);
    const LayerWeights& l = m.layers[0];
    ASSERT_TRUE(l.attn.q_b_proj);
    EXPECT_EQ(l.attn.q_b_proj->weight.dim(0), c.num_attention_heads / 2 * c.qk_head_dim());
    EXPECT_EQ(l.attn.o_proj.weight.dim(1), c.num_attention_heads / 2 * c.v_head_dim);
    ASSERT_TRUE(l.moe);
    EXPECT_EQ(l.moe->experts[0].inter, c.moe_intermediate_size / 2);
    ASSERT_TRUE(l.moe->shared);
    EXPECT_EQ(l.moe->shared->inter, c.moe_intermediate_size * c.n_shared_experts / 2);
    // The module's rows of q_b_proj are the whole tensor's rows of this rank's heads.
    auto whole = (*ckpt).get("model.layers.4.self_attn.q_b_proj.weight");
    ASSERT_TRUE(whole.ok());
    Tensor full = (*ckpt).view(*whole);
    const int64_t rows = l.attn.q_b_proj->weight.dim(0), cols = full.dim(1);
    Tensor full_f32 = Tensor::empty(full.shape(), DType::kF32);
    convert_to_f32(full.raw(), full.dtype(), full_f32.data<float>(), static_cast<size_t>(full.numel()));
    EXPECT_EQ(std::memcmp(l.attn.q_b_proj->weight.data<float>(), full_f32.data<float>() + r * rows * cols,
                          static_cast<size_t>(rows * cols) * sizeof(float)),
              0);
  }
}

TEST(MtpLoad, CheckpointWithoutMtpIsRefused) {
  for (int tp : {1, 2}) {
    ModelOptions o;
    o.load_mtp = true;
    o.tensor_parallel_size = tp;
    auto m = load_deepseek_model(testing::mtp_dir() + "/tiny-dsv3", o, {"num_nextn_predict_layers=0"}, false);
    ASSERT_FALSE(m.ok()) << "TP " << tp;
    EXPECT_NE(m.status().message().find("num_nextn_predict_layers"), std::string::npos) << m.status().to_string();
  }
}

TEST(MtpLoad, MissingMtpTensorIsNamed) {
  // A copy of the MTP checkpoint whose index lists no eh_proj: refused naming it.
  namespace fs = std::filesystem;
  const std::string src = testing::mtp_dir() + "/tiny-dsv3", dir = testing::make_temp_dir("mtp_missing");
  for (const auto& e : fs::directory_iterator(src)) {
    if (e.path().filename() == "model.safetensors.index.json") continue;
    fs::create_symlink(e.path(), fs::path(dir) / e.path().filename());
  }
  std::ifstream in(src + "/model.safetensors.index.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j["weight_map"].erase("model.layers.4.eh_proj.weight");
  std::ofstream(dir + "/model.safetensors.index.json") << j.dump();
  ModelOptions o;
  o.load_mtp = true;
  auto m = load_deepseek_model(dir, o, {}, false);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("model.layers.4.eh_proj.weight"), std::string::npos) << m.status().to_string();
}

}  // namespace
}  // namespace nucleus
