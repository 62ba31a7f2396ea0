// Grammar token masks on the device (kernels/sampling/token_bitmask.cuh)
// against the CPU's apply_token_bitmask, bit for bit: edge vocabularies (1,
// 31, 32, 33, DeepSeek-V3's 129,280), no masked row, one, a subset in any
// order, more rows than one grid's y extent; refusals. Then GrammarMasker
// (runtime/grammar_mask.h) on device logits with real matchers of tiny-dsv3's
// tokenizer against the host path, and a structured-output generation on the
// GPU engine that must parse as the schema asks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "core/cuda/context.h"
#include "core/device.h"
#include "gpu_test_util.h"
#include "io/tokenizer.h"
#include "kernels/sampling/token_bitmask.cuh"
#include "runtime/model_executor.h"
#include "runtime/grammar_mask.h"
#include "runtime/llm_engine.h"
#include "runtime/structured_output.h"
#include "test_util.h"

namespace nucleus {
namespace {

using testing::device_copy;
using testing::host_copy;

class TokenBitmaskGpuTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
};

// Bitwise equality of two f32 vectors; reports the first mismatch as [row, col].
::testing::AssertionResult same_bits(const std::vector<float>& got, const std::vector<float>& want, int64_t vocab) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "first mismatch at [" << i / vocab << ", " << i % vocab << "]: got "
                                           << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

// Runs the kernel on `num_rows` random rows with masks for `rows` and compares
// with the CPU applied to the same rows.
void check_case(int64_t vocab, int64_t num_rows, const std::vector<int32_t>& rows, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "vocab " << vocab << ", rows " << num_rows << ", masked " << rows.size());
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> logits(num_rows * vocab);
  for (auto& l : logits) l = d(rng);
  const int64_t words = token_bitmask_words(vocab);
  std::vector<int32_t> masks(std::max<size_t>(rows.size(), 1) * words);
  for (size_t m = 0; m < rows.size(); ++m)
    for (int64_t w = 0; w < words; ++w) {
      // Mixed words: all-allowed, all-masked and random ones.
      const uint64_t kind = rng() % 4;
      masks[m * words + w] = kind == 0 ? -1 : kind == 1 ? 0 : static_cast<int32_t>(rng());
    }
  std::vector<float> want = logits;
  for (size_t m = 0; m < rows.size(); ++m) apply_token_bitmask(want.data() + rows[m] * vocab, &masks[m * words], vocab);

  Tensor d_logits = device_copy(logits, DType::kF32);
  Tensor d_masks = device_copy(masks, DType::kI32);
  std::vector<int32_t> row_ids = rows.empty() ? std::vector<int32_t>{0} : rows;
  Tensor d_rows = device_copy(row_ids, DType::kI32);
  ASSERT_EQ(kernels::launch_apply_token_bitmask(d_logits.data<float>(), vocab, d_masks.data<int32_t>(),
                                                d_rows.data<int32_t>(), static_cast<int64_t>(rows.size()),
                                                cuda::context().stream),
            cudaSuccess);
  EXPECT_TRUE(same_bits(host_copy<float>(d_logits), want, vocab));
}

TEST_F(TokenBitmaskGpuTest, MatchesCpu) {
  for (int64_t vocab : {1, 31, 32, 33, 4096, 129280}) {
    check_case(vocab, 1, {0}, 1);
    check_case(vocab, 3, {}, 2);            // nothing masked: untouched
    check_case(vocab, 5, {4, 0, 2}, 3);     // a subset, out of order
  }
  std::vector<int32_t> all(256);
  for (int i = 0; i < 256; ++i) all[i] = 255 - i;
  check_case(129280, 256, all, 4);  // the largest decode batch
}

TEST_F(TokenBitmaskGpuTest, MoreRowsThanOneGridY) {
  const int64_t n = 65535 + 7;
  std::vector<int32_t> rows(n);
  for (int64_t i = 0; i < n; ++i) rows[i] = static_cast<int32_t>(i);
  check_case(40, n, rows, 5);
}

TEST_F(TokenBitmaskGpuTest, Refusals) {
  cudaStream_t s = cuda::context().stream;
  EXPECT_EQ(kernels::launch_apply_token_bitmask(nullptr, 0, nullptr, nullptr, 1, s), cudaErrorInvalidValue);
  EXPECT_EQ(kernels::launch_apply_token_bitmask(nullptr, 32, nullptr, nullptr, -1, s), cudaErrorInvalidValue);
  EXPECT_EQ(kernels::launch_apply_token_bitmask(nullptr, int64_t{1} << 32, nullptr, nullptr, 1, s),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::launch_apply_token_bitmask(nullptr, 32, nullptr, nullptr, 0, s), cudaSuccess);
}

const char* kSchema = R"({"type": "object", "properties": {"ok": {"type": "boolean"},
  "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["ok", "n"], "additionalProperties": false})";

// GrammarMasker on device logits equals its host path, rows with and without
// matchers mixed, matchers at different positions.
TEST_F(TokenBitmaskGpuTest, GrammarMaskerDeviceEqualsHost) {
  auto tok = Tokenizer::load(testing::model_path("tiny-dsv3"));
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const int64_t vocab = (*tok)->vocab_size() + 64;  // a padded logits width, as published checkpoints have
  auto compiler = GrammarCompiler::create(**tok, vocab, {1});
  ASSERT_TRUE(compiler.ok()) << compiler.status().to_string();
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kJsonSchema;
  spec.text = kSchema;
  auto grammar = (*compiler)->compile(spec);
  ASSERT_TRUE(grammar.ok()) << grammar.status().to_string();
  // Rows 0..4, then again 5..9 (10 constrained-or-not rows: past the batch
  // size where masks are filled on threads).
  std::vector<std::string> prefixes = {"", R"({"ok": )", "", R"({"ok": true, "n": 4)", R"({"ok": false, "n": 12})"};
  std::vector<bool> constrained = {true, true, false, true, true};
  for (int i = 0; i < 5; ++i) {
    prefixes.push_back(prefixes[i]);
    constrained.push_back(constrained[i]);
  }
  std::vector<Sequence> seqs(prefixes.size());
  std::vector<const Sequence*> rows;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (constrained[i]) {
      seqs[i].grammar_matcher = std::make_shared<GrammarMatcher>(*grammar);
      for (int32_t t : (*tok)->encode(prefixes[i], false)) ASSERT_TRUE(seqs[i].grammar_matcher->accept_token(t));
    }
    rows.push_back(&seqs[i]);
  }
  std::mt19937_64 rng(7);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> logits(rows.size() * vocab);
  for (auto& l : logits) l = d(rng);
  std::vector<float> want = logits;
  GrammarMasker host, device;
  host.apply(rows, want.data(), vocab, Device::kCpu);
  Tensor d_logits = device_copy(logits, DType::kF32);
  device.apply(rows, d_logits.data<float>(), vocab, Device::kCuda);
  EXPECT_TRUE(same_bits(host_copy<float>(d_logits), want, vocab));
  // The masks did something: the complete document allows only the stop token.
  int64_t allowed_last = 0;
  for (int64_t t = 0; t < vocab; ++t) allowed_last += std::isfinite(want[4 * vocab + t]);
  EXPECT_EQ(allowed_last, 1);
  EXPECT_TRUE(std::isfinite(want[4 * vocab + 1]));
  EXPECT_TRUE(same_bits(std::vector<float>(want.begin() + 2 * vocab, want.begin() + 3 * vocab),
                        std::vector<float>(logits.begin() + 2 * vocab, logits.begin() + 3 * vocab), vocab));
}

// The GPU engine (decode graphs, device sampler) with a grammar: seeded
// temperature-1 requests finish with "stop" and their text parses and
// matches the schema.
TEST_F(TokenBitmaskGpuTest, EngineOutputMatchesSchema) {
  auto tok = Tokenizer::load(testing::model_path("tiny-dsv3"));
  ASSERT_TRUE(tok.ok());
  ModelOptions o;
  o.device = Device::kCuda;
  o.cuda_graph_sizes = {1, 2, 4, 8};  // decode replays graphs; masks apply to their logits
  auto model = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const int64_t vocab = (*model)->config().vocab_size;
  EngineConfig ec;
  ec.num_kv_blocks = 256;
  ec.block_size = 16;
  ec.max_num_seqs = 8;
  auto engine = LLMEngine::create(std::move(*model), ec);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto compiler = GrammarCompiler::create(**tok, vocab, (*engine)->config().eos_token_ids);
  ASSERT_TRUE(compiler.ok());
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kJsonSchema;
  spec.text = kSchema;
  // Compact JSON: with whitespace allowed the tiny model's random weights pad
  // the document past max_tokens (the first H200 run: finish "length" after
  // `{"ok"` and 60 whitespace tokens).
  spec.any_whitespace = false;
  auto grammar = (*compiler)->compile(spec);
  ASSERT_TRUE(grammar.ok());
  const int kRequests = 6;
  for (int i = 0; i < kRequests; ++i) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.seed = 100 + i;
    p.max_tokens = 256;
    p.grammar = *grammar;
    ASSERT_TRUE((*engine)->add_request("r" + std::to_string(i), (*tok)->encode("Answer in JSON:"), p).ok());
  }
  std::map<std::string, std::vector<int32_t>> out;
  std::map<std::string, FinishReason> reason;
  while ((*engine)->has_unfinished())
    for (const auto& o : (*engine)->step()) {
      out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finished) reason[o.request_id] = o.finish_reason;
    }
  for (const auto& [id, ids] : out) {
    const std::string text = (*tok)->decode(ids, /*skip_special_tokens=*/true);
    ASSERT_EQ(reason[id], FinishReason::kStop) << id << ": " << text;
    const auto j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << id << ": " << text;
    EXPECT_TRUE(j.is_object() && j.size() == 2 && j["ok"].is_boolean() && j["n"].is_number_integer() &&
                j["n"].get<int>() >= 0 && j["n"].get<int>() <= 99)
        << id << ": " << text;
  }
  EXPECT_EQ(static_cast<int>(out.size()), kRequests);
}

}  // namespace
}  // namespace nucleus
