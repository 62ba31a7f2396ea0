// Tensor parallelism on the CPU reference with the in-process communicator:
// tiny-dsv3 at TP = 2 and 4 gives the same greedy tokens as TP = 1 (and as
// the Hugging Face reference) and logits within 1e-4 of TP = 1, through the
// model, the engine (batched, chunked prefill) and `nucleus generate -tp`;
// the rank graphs carry the collectives; configs that do not split are refused.
// With main's decode-graph passes and cache: TP = 2 with the prezero pass
// (donors that all-reduce and fill) and TP = 2 with the FP8 KV cache (every
// rank's whole latent cache FP8, the same k_scale) match TP = 1.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "runtime/model_executor.h"
#include "ops/op.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

constexpr float kLogitTolerance = 1e-4f;
constexpr int64_t kBlockSize = 16;
constexpr int64_t kNumBlocks = 64;

json ref_cases() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  return json::parse(in)["tiny-dsv3"];
}

std::unique_ptr<ModelExecutor> load(int tp, const std::string& model = "tiny-dsv3", ModelOptions o = {}) {
  o.tensor_parallel_size = tp;
  auto m = load_deepseek_model(testing::model_path(model), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// One sequence's steps through a paged cache (blocks in reverse order).
struct Seq {
  std::vector<int32_t> tokens;
  int64_t cached = 0;
  std::vector<int32_t> blocks;

  StepInputs step(int64_t num_new, bool all_logits) {
    StepInputs in;
    const int64_t needed = (cached + num_new + kBlockSize - 1) / kBlockSize;
    while (static_cast<int64_t>(blocks.size()) < needed)
      blocks.push_back(static_cast<int32_t>(kNumBlocks - 1 - blocks.size()));
    for (int64_t i = 0; i < num_new; ++i) {
      const int64_t pos = cached + i;
      in.token_ids.push_back(tokens[pos]);
      in.positions.push_back(static_cast<int32_t>(pos));
      in.slot_mapping.push_back(blocks[pos / kBlockSize] * kBlockSize + pos % kBlockSize);
      if (all_logits || i == num_new - 1) in.logit_indices.push_back(static_cast<int32_t>(i));
    }
    in.query_start = {0, static_cast<int32_t>(num_new)};
    in.context_lens = {static_cast<int32_t>(cached)};
    in.max_blocks_per_seq = static_cast<int32_t>(blocks.size());
    in.block_tables = blocks;
    cached += num_new;
    return in;
  }
};

int32_t argmax(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return static_cast<int32_t>(best);
}

float max_abs_diff(const Tensor& a, const Tensor& b) {
  NUCLEUS_CHECK(a.numel() == b.numel(), "{} vs {} logits", a.numel(), b.numel());
  float m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(a.data<float>()[i] - b.data<float>()[i]));
  return m;
}

// Prefill with every position's logits, then greedy decode steps through
// each model's cache: the same tokens as each other (and, with
// vs_reference, as the Hugging Face reference), logits within `tolerance` at
// every step. Returns the largest logit difference.
float compare_greedy(ModelExecutor& one, ModelExecutor& many, int tp, float tolerance, bool vs_reference = true) {
  const int64_t V = one.config().vocab_size;
  const json cases = ref_cases();
  float worst = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    SCOPED_TRACE("prompt " + std::to_string(ci));
    Seq a, b;
    a.tokens = b.tokens = cases[ci]["prompt_token_ids"].get<std::vector<int32_t>>();
    KvCache kv1 = one.make_kv_cache(kNumBlocks, kBlockSize), kvn = many.make_kv_cache(kNumBlocks, kBlockSize);
    EXPECT_EQ(kvn.ranks.size(), static_cast<size_t>(tp));
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    auto l1 = one.forward(a.step(n, true), kv1);
    auto ln = many.forward(b.step(n, true), kvn);
    EXPECT_TRUE(l1.ok() && ln.ok());
    if (!l1.ok() || !ln.ok()) return INFINITY;
    float diff = max_abs_diff(*l1, *ln);
    EXPECT_LT(diff, tolerance) << "prefill logits";
    worst = std::max(worst, diff);
    std::vector<int32_t> got1, gotn;
    int32_t next1 = argmax(l1->data<float>() + (n - 1) * V, V), nextn = argmax(ln->data<float>() + (n - 1) * V, V);
    const auto expect = cases[ci]["greedy_token_ids"].get<std::vector<int32_t>>();
    for (size_t step = 0; step < expect.size(); ++step) {
      got1.push_back(next1);
      gotn.push_back(nextn);
      a.tokens.push_back(next1);
      b.tokens.push_back(nextn);
      auto d1 = one.forward(a.step(1, false), kv1);
      auto dn = many.forward(b.step(1, false), kvn);
      EXPECT_TRUE(d1.ok() && dn.ok());
      if (!d1.ok() || !dn.ok()) return INFINITY;
      diff = max_abs_diff(*d1, *dn);
      EXPECT_LT(diff, tolerance) << "decode step " << step;
      worst = std::max(worst, diff);
      next1 = argmax(d1->data<float>(), V);
      nextn = argmax(dn->data<float>(), V);
    }
    EXPECT_EQ(gotn, got1);
    if (vs_reference) {
      EXPECT_EQ(gotn, expect) << "vs the Hugging Face reference";
    }
  }
  return worst;
}

class TpVsTp1Test : public ::testing::TestWithParam<int> {};

// Prefill with every position's logits, then 32 greedy decode steps through
// each model's cache: the same tokens, logits within 1e-4 at every step.
TEST_P(TpVsTp1Test, SameGreedyTokensAndLogitsWithin1e4) {
  const int tp = GetParam();
  auto one = load(1), many = load(tp);
  ASSERT_EQ(many->tensor_parallel_size(), tp);
  const float worst = compare_greedy(*one, *many, tp, kLogitTolerance);
  std::printf("TP=%d vs TP=1: max |logit difference| %.3g over all prompts and steps\n", tp, worst);
}

INSTANTIATE_TEST_SUITE_P(TinyDsv3, TpVsTp1Test, ::testing::Values(2, 4));

// The prezero pass on every rank's decode graph: the norms that all-reduce
// o_proj's and the MLP/MoE's partial sums are also the donors (both
// attributes on one op), o_proj writes its slice of the donor's buffer and
// the next norm all-reduces that slice. TP = 2 with prezero equals TP = 1
// without it.
TEST(TpPrezeroTest, AllReducingDonorsMatchTp1) {
  ModelOptions o;
  o.enable_prezero = true;
  auto one = load(1), many = load(2, "tiny-dsv3", o);
  for (int r = 0; r < 2; ++r) {
    const StepGraph& g = many->rank(r).graph(StepKind::kDecode);
    int donors = 0, all_reducing_donors = 0;
    for (const auto& n : g.nodes()) {
      const std::string attrs = n.op->attrs();
      if (attrs.find("prezero_n_total=") == std::string::npos) continue;
      ++donors;
      if (attrs.find("allreduce=inprocessx2") != std::string::npos) ++all_reducing_donors;
    }
    // Two donors per layer (4 layers); all but layer 0's input norm (no
    // delta: the residual is the embedding) all-reduce.
    EXPECT_EQ(donors, 8) << "rank " << r;
    EXPECT_EQ(all_reducing_donors, 7) << "rank " << r;
    const Node* post = nullptr;
    for (const auto& n : g.nodes())
      if (n.name == "layers.1.post_attention_layernorm") post = &n;
    ASSERT_NE(post, nullptr);
    EXPECT_EQ(g.buffers()[post->inputs[1]].name, "prezero.1.attn.o_proj") << "o_proj's slice is the reduced delta";
  }
  const float worst = compare_greedy(*one, *many, 2, kLogitTolerance);
  std::printf("TP=2 + prezero vs TP=1: max |logit difference| %.3g\n", worst);
}

// The FP8 KV cache under tensor parallelism: every rank's whole latent cache
// is FP8 with the same k_scale (--kv-scale here), and TP = 2 gives TP = 1's
// greedy tokens with logits within FP8 noise of TP = 1 on the same cache
// dtype (a partial sum rounded differently can flip an e4m3 rounding).
TEST(TpKvCacheFp8Test, EveryRankKeepsTheWholeFp8CacheAndMatchesTp1) {
  ModelOptions o;
  o.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
  o.kv_scale = 0.05f;
  auto one = load(1, "tiny-dsv3", o), many = load(2, "tiny-dsv3", o);
  EXPECT_EQ(many->kv_cache_dtype(), KvCacheDtype::kFp8E4M3);
  EXPECT_EQ(many->kv_bytes_per_token(), one->kv_bytes_per_token());
  KvCache kv = many->make_kv_cache(kNumBlocks, kBlockSize);
  ASSERT_EQ(kv.ranks.size(), 2u);
  for (const KvCache& r : kv.ranks) {
    EXPECT_EQ(r.dtype(), KvCacheDtype::kFp8E4M3);
    EXPECT_EQ(r.width, one->config().kv_cache_width()) << "the whole latent row on every rank";
    ASSERT_EQ(r.k_scale.size(), static_cast<size_t>(one->config().num_hidden_layers));
    for (float k : r.k_scale) EXPECT_EQ(k, 0.05f);
  }
  const float worst = compare_greedy(*one, *many, 2, 2e-2f, /*vs_reference=*/false);
  std::printf("TP=2 vs TP=1, FP8 KV cache: max |logit difference| %.3g\n", worst);
}

TEST(TpEngineTest, BatchedChunkedGreedyEqualsReferenceAtTp2) {
  EngineConfig c;
  c.block_size = kBlockSize;
  c.num_kv_blocks = 128;
  c.max_num_batched_tokens = 48;  // chunked prefill mixed with decodes
  auto e = LLMEngine::create(load(2), c);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  const json cases = ref_cases();
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 32;
  p.ignore_eos = true;
  for (size_t i = 0; i < cases.size(); ++i)
    ASSERT_TRUE((*e)->add_request("r" + std::to_string(i), cases[i]["prompt_token_ids"].get<std::vector<int32_t>>(), p)
                    .ok());
  std::map<std::string, std::vector<int32_t>> out;
  while ((*e)->has_unfinished())
    for (const auto& o : (*e)->step())
      out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  for (size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(out["r" + std::to_string(i)], cases[i]["greedy_token_ids"].get<std::vector<int32_t>>()) << i;
}

TEST(TpGraphTest, RankGraphsCarryTheCollectives) {
  auto m = load(2);
  for (StepKind kind : {StepKind::kPrefill, StepKind::kDecode}) {
    const StepGraph& g = m->rank(1).graph(kind);
    int all_reduce_norms = 0, gathers = 0, embeddings = 0;
    for (const auto& n : g.nodes()) {
      const std::string attrs = n.op->attrs();
      if (std::string(n.op->kind()) == "add_rmsnorm" && attrs.find("allreduce=inprocessx2") != std::string::npos)
        ++all_reduce_norms;
      if (std::string(n.op->kind()) == "all_gather_vocab") ++gathers;
      if (std::string(n.op->kind()) == "embedding") {
        ++embeddings;
        EXPECT_NE(attrs.find("vocab=2048"), std::string::npos) << attrs;
        EXPECT_NE(attrs.find("vocab_start=2048"), std::string::npos) << attrs;
      }
    }
    // After o_proj (4 layers) and after the MLP/MoE (4 layers; the last one's
    // sum rides in the final norm): 8 fused all-reduces.
    EXPECT_EQ(all_reduce_norms, 8);
    EXPECT_EQ(gathers, 1);
    EXPECT_EQ(embeddings, 1);
  }
  // Rank 1 holds heads 2-3: q is 2 heads wide.
  const StepGraph& g = m->rank(1).graph(StepKind::kDecode);
  EXPECT_EQ(g.buffers()[g.find_buffer("q")].width, 2 * 192);
  EXPECT_EQ(g.buffers()[g.find_buffer("logits")].width, 4096);
  EXPECT_EQ(g.buffers()[g.find_buffer("logits_local")].width, 2048);
}

TEST(TpConfigTest, SizesThatDoNotSplitAreRefused) {
  ModelOptions o;
  o.tensor_parallel_size = 3;
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("num_attention_heads 4 is not divisible by --tensor-parallel-size 3"),
            std::string::npos)
      << m.status().to_string();
  o.tensor_parallel_size = 2;
  auto fp8 = load_deepseek_model(testing::model_path("tiny-dsv3-fp8"), o, {}, false);
  ASSERT_FALSE(fp8.ok());
  EXPECT_NE(fp8.status().message().find("inside a 128-wide block"), std::string::npos) << fp8.status().to_string();
  EXPECT_NE(fp8.status().message().find("rank "), std::string::npos) << fp8.status().to_string();
}

// `nucleus generate --device cpu -tp 2` prints what TP = 1 prints, with MTP
// speculative decoding too (tiny-dsv3 holds its MTP layer).
TEST(TpCliTest, GenerateWithTensorParallelSizeTwoMatchesOne) {
  const char* bin = std::getenv("NUCLEUS_BIN");
  ASSERT_NE(bin, nullptr) << "NUCLEUS_BIN is not set (run through ctest)";
  auto run = [&](const std::string& tp_flag) {
    const std::string cmd = std::string(bin) + " generate --device cpu --model " + testing::model_path("tiny-dsv3") +
                            " --prompt 'def fibonacci(n):' --max-tokens 24 --ignore-eos --json " + tp_flag +
                            " 2>&1";
    std::string out;
    FILE* p = popen(cmd.c_str(), "r");
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    const int st = pclose(p);
    EXPECT_EQ(WIFEXITED(st) ? WEXITSTATUS(st) : -1, 0) << cmd << "\n" << out;
    const size_t brace = out.find("{\"");
    return brace == std::string::npos ? out : json::parse(out.substr(brace, out.find('\n', brace) - brace))["token_ids"].dump();
  };
  const std::string one = run(""), two = run("-tp 2"), two_long = run("--tensor-parallel-size=2");
  EXPECT_EQ(two, one);
  EXPECT_EQ(two_long, one);
  EXPECT_EQ(run("-tp 2 --speculative-config '{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 2}'"), one);
  EXPECT_NE(one.find(','), std::string::npos) << one;  // a list of 24 ids
}

// NUCLEUS_FORCE_KERNEL's family list (ops/op.cpp) names every op of the
// graphs, a rank's included (its collectives), so no family is refused as
// unknown.
TEST(TpTest, EveryGraphNodeIsAForceableKernelFamily) {
  auto m = load(2);
  for (StepKind k : {StepKind::kPrefill, StepKind::kDecode})
    for (const auto& n : m->rank(0).graph(k).nodes())
      EXPECT_TRUE(is_kernel_family(n.op->kind())) << n.name << ": " << n.op->kind();
  EXPECT_TRUE(is_kernel_family("gather_kv_b_proj"));
  EXPECT_FALSE(is_kernel_family("linearr"));
}

}  // namespace
}  // namespace nucleus
