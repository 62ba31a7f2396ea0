// The FP8 KV cache end to end on the CPU reference with tiny-dsv3:
//  - k_scale from the checkpoint (k_scale / kv_scale tensors per layer),
//    --kv-scale overriding it, bad or disagreeing scale tensors refused;
//  - the spellings: `--kv-cache-dtype fp8` and `fp8_e4m3` are one setting (same
//    model, same output, same log line); other spellings are usage errors
//    naming the accepted values; the model's cache bytes per token are 1/2
//    of bf16's (the pool holds twice the tokens in the same memory);
//  - a token's row written by a prefill step and by a decode step are
//    byte-identical (k_scale 1 and 0.05), and k_scale changes the bytes but
//    not what attention reads (logits within the FP8 tolerance);
//  - batching, chunked prefill (the cached-prefix path) and the prefix cache
//    do not change an FP8-cache request's greedy output (exactly, on the CPU);
//  - 512 greedy tokens with the FP8 cache against the bf16 cache, agreement
//    per 100-token window not degrading with length (thresholds below).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "runtime/model_executor.h"
#include "runtime/llm_engine.h"
#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;

std::vector<std::vector<int32_t>> ref_prompts() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  const json all = json::parse(in);
  std::vector<std::vector<int32_t>> out;
  for (const auto& c : all["tiny-dsv3"]) out.push_back(c["prompt_token_ids"].get<std::vector<int32_t>>());
  return out;
}

std::unique_ptr<ModelExecutor> load(std::optional<KvCacheDtype> dtype, std::optional<float> kv_scale = {}) {
  ModelOptions o;
  o.kv_cache_dtype = dtype;
  o.kv_scale = kv_scale;
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// ------------------------------------------------------------- the setting ---

struct RunResult {
  int status = -1;
  std::string out;
};

// Runs the binary with `args`; stdout only, or with stderr (the log) too.
RunResult run_binary(const std::string& args, bool with_stderr) {
  const char* bin = std::getenv("NUCLEUS_BIN");
  std::string cmd = bin ? bin : "nucleus";
  cmd.append(" ").append(args).append(with_stderr ? " 2>&1" : " 2>/dev/null");
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

TEST(KvCacheFp8Cli, BothSpellingsAreOneSettingOthersAreUsageErrors) {
  ASSERT_NE(std::getenv("NUCLEUS_BIN"), nullptr) << "run through ctest (NUCLEUS_BIN)";
  const std::string base = "generate --device cpu --model " + testing::model_path("tiny-dsv3") +
                           " --prompt 'def f(x):' --max-tokens 12 --ignore-eos --json --kv-cache-dtype ";
  std::vector<std::string> outs;
  for (const char* spelling : {"fp8", "fp8_e4m3"}) {
    RunResult r = run_binary(base + spelling, false);
    ASSERT_EQ(r.status, 0) << spelling << "\n" << r.out;
    outs.push_back(r.out);
    r = run_binary(base + spelling, true);  // the engine's log names the canonical setting
    EXPECT_NE(r.out.find("fp8_e4m3 cache, 2304 B/token"), std::string::npos) << spelling << "\n" << r.out;
  }
  EXPECT_EQ(outs[0], outs[1]);
  EXPECT_NE(outs[0].find("token_ids"), std::string::npos) << outs[0];
  for (const char* bad : {"fp16", "FP8", "fp8_e5m2"}) {
    RunResult r = run_binary(base + bad, true);
    EXPECT_EQ(r.status, 2) << bad << "\n" << r.out;
    EXPECT_NE(r.out.find("auto, bf16, fp8, fp8_e4m3"), std::string::npos) << bad << "\n" << r.out;
  }
  RunResult r = run_binary(base + "bf16 --kv-scale 0.5", true);  // a scale for a cache that is never scaled
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("--kv-scale applies to an FP8 KV cache only"), std::string::npos) << r.out;
  r = run_binary(base + "fp8 --kv-scale 0", true);
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("finite and > 0"), std::string::npos) << r.out;
}

TEST(KvCacheFp8Model, SpellingsResolveToOneDtypeAndHalveTheBytes) {
  auto f32 = load(std::nullopt);  // auto on the CPU
  auto bf16 = load(*parse_kv_cache_dtype("bf16"));
  auto fp8 = load(*parse_kv_cache_dtype("fp8"));
  auto fp8_e4m3 = load(*parse_kv_cache_dtype("fp8_e4m3"));
  EXPECT_EQ(f32->kv_cache_dtype(), KvCacheDtype::kF32);
  EXPECT_EQ(bf16->kv_cache_dtype(), KvCacheDtype::kBF16);
  EXPECT_EQ(fp8->kv_cache_dtype(), KvCacheDtype::kFp8E4M3);
  EXPECT_EQ(fp8_e4m3->kv_cache_dtype(), fp8->kv_cache_dtype());
  // 4 layers x 576 elements.
  EXPECT_EQ(f32->kv_bytes_per_token(), 4 * 576 * 4);
  EXPECT_EQ(bf16->kv_bytes_per_token(), 4 * 576 * 2);
  EXPECT_EQ(fp8->kv_bytes_per_token(), 4 * 576 * 1);
  const KvCache a = bf16->make_kv_cache(10, 16), b = fp8->make_kv_cache(10, 16);
  EXPECT_EQ(a.data.nbytes(), 2 * b.data.nbytes());
  EXPECT_EQ(b.data.dtype(), DType::kF8E4M3);
  // The same bytes hold twice the blocks.
  EXPECT_EQ(fp8->make_kv_cache(20, 16).data.nbytes(), a.data.nbytes());
  // Every node that touches the cache was built for it.
  for (StepKind k : {StepKind::kPrefill, StepKind::kDecode})
    for (const auto& n : fp8->graph(k).nodes()) {
      const std::string kind = n.op->kind();
      if (kind == "rope_kv_cache_write" || kind == "mla_decode" || kind == "mla_prefill") {
        EXPECT_NE(n.op->attrs().find("cache=fp8_e4m3"), std::string::npos) << n.name << " " << n.op->attrs();
      }
    }
  // k_scale: 1.0 without a checkpoint scale, --kv-scale for every layer.
  EXPECT_EQ(fp8->kv_k_scales(), std::vector<float>(4, 1.0f));
  EXPECT_EQ(load(KvCacheDtype::kFp8E4M3, 0.05f)->kv_k_scales(), std::vector<float>(4, 0.05f));
  EXPECT_EQ(fp8->make_kv_cache(2, 16).k_scale, std::vector<float>(4, 1.0f));
}

// ---------------------------------------------------- one sequence, by hand ---

// One sequence through ModelExecutor::forward, its own cache (block size 16).
class SeqRunner {
 public:
  SeqRunner(ModelExecutor* m, int64_t max_tokens) : m_(m) {
    kv_ = m->make_kv_cache((max_tokens + 15) / 16, 16);
    for (int32_t b = 0; b < kv_.num_blocks; ++b) table_.push_back(b);
  }
  KvCache& kv() { return kv_; }
  // Runs `tokens` (positions len_.. on) as one step; the last token's logits.
  std::vector<float> step(const std::vector<int32_t>& tokens) {
    StepInputs si;
    const auto n = static_cast<int32_t>(tokens.size());
    si.token_ids = tokens;
    for (int32_t i = 0; i < n; ++i) {
      si.positions.push_back(len_ + i);
      si.slot_mapping.push_back(len_ + i);
    }
    si.query_start = {0, n};
    si.context_lens = {len_};
    si.block_tables = table_;
    si.max_blocks_per_seq = static_cast<int32_t>(table_.size());
    si.logit_indices = {n - 1};
    auto logits = m_->forward(si, kv_);
    NUCLEUS_CHECK(logits.ok(), "{}", logits.status().to_string());
    len_ += n;
    return std::vector<float>(logits->data<float>(), logits->data<float>() + logits->numel());
  }
  // Row bytes of `slot` in `layer`, or in every layer (layer -1).
  std::vector<uint8_t> row_bytes(int64_t slot, int64_t layer = -1) const {
    const size_t row = static_cast<size_t>(kv_.width) * dtype_size(kv_.data.dtype());
    std::vector<uint8_t> out;
    for (int64_t l = 0; l < kv_.num_layers; ++l) {
      if (layer >= 0 && l != layer) continue;
      const auto* p = static_cast<const uint8_t*>(kv_.layer_data(l)) + slot * row;
      out.insert(out.end(), p, p + row);
    }
    return out;
  }

 private:
  ModelExecutor* m_;
  KvCache kv_;
  std::vector<int32_t> table_;
  int32_t len_ = 0;
};

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

double rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s / std::max<size_t>(v.size(), 1));
}

double rms_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
  return std::sqrt(s / std::max<size_t>(a.size(), 1));
}

TEST(KvCacheFp8Model, PrefillRowEqualsDecodeRowAndKScaleIsUndoneOnRead) {
  const std::vector<int32_t> prompt = ref_prompts()[3];  // 118 tokens
  const int64_t n = static_cast<int64_t>(prompt.size());
  std::vector<std::vector<uint8_t>> rows_by_scale;
  std::vector<std::vector<float>> logits_by_scale;
  for (float k_scale : {1.0f, 0.05f}) {
    SCOPED_TRACE("k_scale " + std::to_string(k_scale));
    auto m = load(KvCacheDtype::kFp8E4M3, k_scale);
    SeqRunner prefill(m.get(), n), decode(m.get(), n);
    const std::vector<float> logits = prefill.step(prompt);
    decode.step(std::vector<int32_t>(prompt.begin(), prompt.end() - 1));
    const std::vector<float> decode_logits = decode.step({prompt.back()});
    // The last token: written by a prefill step of n tokens, and by a decode step.
    EXPECT_EQ(prefill.row_bytes(n - 1), decode.row_bytes(n - 1));
    for (int64_t t = 0; t < n - 1; ++t) ASSERT_EQ(prefill.row_bytes(t), decode.row_bytes(t)) << "token " << t;
    // Reading them: decode (absorbed) and prefill (expanded) agree within float rounding.
    EXPECT_LE(rms_diff(logits, decode_logits), 1e-4 * rms(logits));
    rows_by_scale.push_back(prefill.row_bytes(n - 1));
    logits_by_scale.push_back(logits);
  }
  // k_scale 0.05 stores other bytes than 1.0 ...
  size_t differ = 0;
  for (size_t i = 0; i < rows_by_scale[0].size(); ++i) differ += rows_by_scale[0][i] != rows_by_scale[1][i];
  EXPECT_GT(differ, rows_by_scale[0].size() * 9 / 10);
  // ... and reads back the same model: the logits agree within the FP8 rounding
  // (the two caches round different values), far below what a scale left
  // on the stored bytes (x20) would do.
  const double d = rms_diff(logits_by_scale[0], logits_by_scale[1]) / rms(logits_by_scale[0]);
  std::printf("k_scale 1 vs 0.05: relative RMS logit difference %.4f\n", d);
  EXPECT_LE(d, 0.05);
}

// ------------------------------------------------------ checkpoint scales ---

// A copy of tiny-dsv3 with one more shard holding `scales` (name -> bytes of
// a safetensors tensor of `dtype` and `shape`), listed in the index.
struct ScaleTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

std::string copy_with_scales(const std::vector<ScaleTensor>& scales) {
  namespace fs = std::filesystem;
  const std::string dir = testing::make_temp_dir("nucleus_kvscale_");
  for (const auto& de : fs::directory_iterator(testing::model_path("tiny-dsv3")))
    fs::copy_file(de.path(), fs::path(dir) / de.path().filename());
  json header = json::object();
  std::string data;
  for (const auto& t : scales) {
    std::string bytes;
    for (float v : t.values) {
      if (t.dtype == "F32") {
        bytes.append(reinterpret_cast<const char*>(&v), 4);
      } else {  // BF16
        const uint16_t h = f32_to_bf16(v);
        bytes.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data += bytes;
  }
  const std::string h = header.dump();
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((static_cast<uint64_t>(h.size()) >> (8 * i)) & 0xff);
  file += h + data;
  std::ofstream(dir + "/model-kv-scales.safetensors", std::ios::binary) << file;
  json index;
  {
    std::ifstream in(dir + "/model.safetensors.index.json");
    index = json::parse(in);
  }
  for (const auto& t : scales) index["weight_map"][t.name] = "model-kv-scales.safetensors";
  fs::remove(dir + "/model.safetensors.index.json");
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2);
  return dir;
}

StatusOr<std::unique_ptr<ModelExecutor>> load_dir(const std::string& dir, std::optional<KvCacheDtype> dtype,
                                                  std::optional<float> kv_scale = {}) {
  ModelOptions o;
  o.kv_cache_dtype = dtype;
  o.kv_scale = kv_scale;
  return load_deepseek_model(dir, o, {}, false);
}

TEST(KvCacheFp8Checkpoint, ScalesAreReadPerLayerAndOverridden) {
  // vLLM / ATOM / ModelOpt spellings, one per layer; layer 3 has none (1.0);
  // layer 2 carries a v_scale too (accepted, unused), and both spellings agreeing.
  const std::string dir = copy_with_scales({
      {"model.layers.0.self_attn.k_scale", "F32", {}, {0.02f}},
      {"model.layers.1.self_attn.kv_scale", "BF16", {1}, {0.5f}},
      {"model.layers.2.self_attn.attn.k_scale", "F32", {1}, {4.0f}},
      {"model.layers.2.self_attn.mla_attn.kv_scale", "F32", {}, {4.0f}},
      {"model.layers.2.self_attn.attn.v_scale", "F32", {}, {9.0f}},
  });
  auto fp8 = load_dir(dir, KvCacheDtype::kFp8E4M3);
  ASSERT_TRUE(fp8.ok()) << fp8.status().to_string();
  EXPECT_EQ((*fp8)->kv_k_scales(), (std::vector<float>{0.02f, 0.5f, 4.0f, 1.0f}));
  EXPECT_EQ((*fp8)->make_kv_cache(2, 16).k_scale, (std::vector<float>{0.02f, 0.5f, 4.0f, 1.0f}));
  auto overridden = load_dir(dir, KvCacheDtype::kFp8E4M3, 0.25f);
  ASSERT_TRUE(overridden.ok());
  EXPECT_EQ((*overridden)->kv_k_scales(), std::vector<float>(4, 0.25f));
  // A bf16 cache is never scaled: the tensors are read (the checkpoint loads) and unused.
  auto bf16 = load_dir(dir, KvCacheDtype::kBF16);
  ASSERT_TRUE(bf16.ok()) << bf16.status().to_string();
  EXPECT_EQ((*bf16)->kv_k_scales(), std::vector<float>(4, 1.0f));
  EXPECT_TRUE((*bf16)->make_kv_cache(2, 16).k_scale.empty());
  // The stored bytes follow the per-layer scales: layer 0 (0.02) as with
  // --kv-scale 0.02 on every layer, layer 1 (0.5) not.
  auto all_002 = load_dir(dir, KvCacheDtype::kFp8E4M3, 0.02f);
  ASSERT_TRUE(all_002.ok());
  const std::vector<int32_t> prompt = ref_prompts()[0];
  const auto n = static_cast<int64_t>(prompt.size());
  SeqRunner a(fp8->get(), n), b(all_002->get(), n);
  a.step(prompt);
  b.step(prompt);
  for (int64_t t = 0; t < n; ++t) {
    ASSERT_EQ(a.row_bytes(t, 0), b.row_bytes(t, 0)) << "token " << t;
    EXPECT_NE(a.row_bytes(t, 1), b.row_bytes(t, 1)) << "token " << t;
  }
}

TEST(KvCacheFp8Checkpoint, BadScaleTensorsAreRefusedNamingThem) {
  struct Case {
    std::vector<ScaleTensor> scales;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{"model.layers.1.self_attn.k_scale", "F32", {}, {0.0f}}}, "model.layers.1.self_attn.k_scale"},
      {{{"model.layers.1.self_attn.k_scale", "F32", {}, {-2.0f}}}, "finite and > 0"},
      {{{"model.layers.1.self_attn.k_scale", "F32", {2}, {1.0f, 2.0f}}}, "one F32, BF16 or F16 value"},
      {{{"model.layers.0.self_attn.k_scale", "F32", {}, {1.0f}}, {"model.layers.0.self_attn.kv_scale", "F32", {}, {2.0f}}},
       "disagree"},
      {{{"model.layers.0.self_attn.q_scale", "F32", {}, {1.0f}}}, "unexpected tensor"},
  };
  for (const Case& c : cases) {
    auto m = load_dir(copy_with_scales(c.scales), KvCacheDtype::kFp8E4M3);
    ASSERT_FALSE(m.ok()) << c.message;
    EXPECT_NE(m.status().message().find(c.message), std::string::npos) << m.status().message();
  }
}

// ------------------------------------------------------ engine consistency ---

SamplingParams greedy(int n) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = n;
  p.ignore_eos = true;
  return p;
}

std::map<std::string, std::vector<int32_t>> run_all(LLMEngine& e, const std::vector<std::vector<int32_t>>& prompts,
                                                   const std::string& tag, int max_tokens = 24) {
  for (size_t i = 0; i < prompts.size(); ++i)
    NUCLEUS_CHECK_OK(e.add_request(tag + std::to_string(i), prompts[i], greedy(max_tokens)));
  std::map<std::string, std::vector<int32_t>> out;
  while (e.has_unfinished())
    for (const auto& o : e.step())
      out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  return out;
}

EngineConfig config(int64_t budget, int64_t blocks = 256) {
  EngineConfig c;
  c.block_size = 16;
  c.num_kv_blocks = blocks;
  c.max_num_batched_tokens = budget;
  return c;
}

TEST(KvCacheFp8Engine, BatchingChunkingAndPrefixCacheDoNotChangeOutputs) {
  const auto prompts = ref_prompts();
  // Each prompt alone, in one prefill step.
  std::map<size_t, std::vector<int32_t>> alone;
  {
    auto e = LLMEngine::create(load(KvCacheDtype::kFp8E4M3, 0.05f), config(8192));
    ASSERT_TRUE(e.ok());
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::string tag = "alone" + std::to_string(i) + "_";
      alone[i] = run_all(**e, {prompts[i]}, tag)[tag + "0"];
    }
  }
  // Batched, chunked down to 7 tokens a step (every later chunk reads the
  // earlier ones from the FP8 cache), then again from the prefix cache.
  for (int64_t budget : {8192, 64, 7}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    auto e = LLMEngine::create(load(KvCacheDtype::kFp8E4M3, 0.05f), config(budget));
    ASSERT_TRUE(e.ok());
    for (const char* tag : {"first", "second"}) {
      auto got = run_all(**e, prompts, tag);
      for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[tag + std::to_string(i)], alone[i]) << tag << i;
    }
    EXPECT_GT((*e)->stats().prefix_hit_tokens, 0);
  }
}

// -------------------------------------------------------- long generation ---
//
// 512 greedy tokens after a 118-token prompt with tiny-dsv3. Its random
// weights loop with a short period and have near-ties (the free-running FP8
// and bf16 generations already part at the first token), so matching
// free-running outputs would measure ties and repetition, not the cache: the
// gate is on teacher-forced steps. The bf16-cache greedy generation is the
// sequence; the FP8 cache (and, as the exact reference, the f32 cache) is fed
// that same sequence one decode step at a time (rows written by decode, as in
// generation). Per 100-token window (tokens 0-99, ..., 400-499; the last 12
// reported and counted in the overall agreement):
//   agree     = share of steps whose FP8 top-1 is the bf16 greedy token,
//   err       = RMS(logits_fp8 - logits_bf16) / RMS(logits_bf16),
//   amplified = err_fp8 / err_bf16, both against the f32 cache: the FP8
//               error relative to what bf16 rounding does at the same context
//               (this sequence's later windows are ~2x more sensitive to any
//               rounding of the cache, bf16's included).
// Required: agree >= 0.9 in each window and over all 512; err <= 0.08; no
// degradation with length: amplified in window 4 <= 2x window 0. Measured:
// agree 0.94-1.0 (0.96 overall), err 0.020-0.055, amplified 15-24
// (window 4 / window 0: x1.4). Negative control: a cache whose rows are read with another
// scale than they were written with (k_scale alternating 1.0 / 1.7 between
// steps) reaches agree 0.41 and err 0.52, failing both bounds.

constexpr double kMinAgree = 0.9, kMaxErr = 0.08, kMaxAmplificationGrowth = 2.0;

// Teacher-forced: `model` fed `seq` after `prompt`, one decode step a token;
// the logits before each token of `seq`.
std::vector<std::vector<float>> teacher_forced(ModelExecutor* model, const std::vector<int32_t>& prompt,
                                               const std::vector<int32_t>& seq, bool alternate_scale = false) {
  SeqRunner r(model, static_cast<int64_t>(prompt.size() + seq.size()));
  std::vector<std::vector<float>> out = {r.step(prompt)};
  for (size_t i = 0; i + 1 < seq.size(); ++i) {
    if (alternate_scale) r.kv().k_scale.assign(r.kv().k_scale.size(), i % 2 ? 1.0f : 1.7f);
    out.push_back(r.step({seq[i]}));
  }
  return out;
}

struct Window {
  size_t begin, end;
  double agree, err, amplified;
};

// Per window of 100 steps (the last may be shorter).
std::vector<Window> windows(const std::vector<int32_t>& seq, const std::vector<std::vector<float>>& fp8,
                            const std::vector<std::vector<float>>& bf16, const std::vector<std::vector<float>>& f32) {
  std::vector<Window> out;
  for (size_t b = 0; b < seq.size(); b += 100) {
    Window w{b, std::min(seq.size(), b + 100), 0, 0, 0};
    double agree = 0, e2 = 0, r2 = 0, e8 = 0, e16 = 0, r32 = 0;
    for (size_t i = w.begin; i < w.end; ++i) {
      agree += argmax(fp8[i]) == seq[i];
      e2 += std::pow(rms_diff(fp8[i], bf16[i]), 2);
      r2 += std::pow(rms(bf16[i]), 2);
      e8 += std::pow(rms_diff(fp8[i], f32[i]), 2);
      e16 += std::pow(rms_diff(bf16[i], f32[i]), 2);
      r32 += std::pow(rms(f32[i]), 2);
    }
    w.agree = agree / static_cast<double>(w.end - w.begin);
    w.err = std::sqrt(e2 / r2);
    w.amplified = std::sqrt(e8 / std::max(e16, 1e-30));
    out.push_back(w);
  }
  return out;
}

TEST(KvCacheFp8Engine, LongGenerationAgreesPerWindowWithoutDegrading) {
  const std::vector<int32_t> prompt = ref_prompts()[3];  // 118 tokens; 118 + 512 <= 1024 positions
  constexpr int kTokens = 512;
  auto f32 = load(std::nullopt);
  auto bf16 = load(KvCacheDtype::kBF16);
  auto fp8 = load(KvCacheDtype::kFp8E4M3);
  // The sequence: bf16-cache greedy generation.
  std::vector<int32_t> seq;
  std::vector<std::vector<float>> bf16_logits;
  {
    SeqRunner r(bf16.get(), static_cast<int64_t>(prompt.size()) + kTokens);
    std::vector<float> logits = r.step(prompt);
    for (int i = 0; i < kTokens; ++i) {
      bf16_logits.push_back(logits);
      seq.push_back(argmax(logits));
      if (i + 1 < kTokens) logits = r.step({seq.back()});
    }
  }
  // Free-running FP8 generation: reported only (see above).
  {
    SeqRunner r(fp8.get(), static_cast<int64_t>(prompt.size()) + kTokens);
    std::vector<float> logits = r.step(prompt);
    int first_diff = -1, same = 0;
    for (int i = 0; i < kTokens; ++i) {
      const int32_t t = argmax(logits);
      same += t == seq[i];
      if (t != seq[i] && first_diff < 0) first_diff = i;
      if (i + 1 < kTokens) logits = r.step({t});
    }
    std::printf("free-running fp8 vs bf16 (reported, not gated): first different token at step %d, %d of %d equal\n",
                first_diff, same, kTokens);
  }
  const auto f32_logits = teacher_forced(f32.get(), prompt, seq);
  const auto fp8_logits = teacher_forced(fp8.get(), prompt, seq);
  const std::vector<Window> w = windows(seq, fp8_logits, bf16_logits, f32_logits);
  ASSERT_EQ(w.size(), 6u);
  double agree_all = 0;
  for (const Window& x : w) {
    agree_all += x.agree * static_cast<double>(x.end - x.begin);
    std::printf("window tokens %3zu-%3zu: top-1 agreement %.3f, relative RMS logit error %.4f, fp8/bf16 error %.1f\n",
                x.begin, x.end - 1, x.agree, x.err, x.amplified);
    if (x.end - x.begin < 100) continue;  // the 12-token tail: in the overall agreement
    EXPECT_GE(x.agree, kMinAgree) << "window " << x.begin;
    EXPECT_LE(x.err, kMaxErr) << "window " << x.begin;
  }
  EXPECT_GE(agree_all / kTokens, kMinAgree);
  EXPECT_LE(w[4].amplified, kMaxAmplificationGrowth * w[0].amplified) << "the FP8 error grows with length";
  // Negative control: inconsistent write/read scales must fail the bounds.
  const auto bad_logits = teacher_forced(fp8.get(), prompt, seq, true);
  const std::vector<Window> bad = windows(seq, bad_logits, bf16_logits, f32_logits);
  double worst_err = 0, worst_agree = 1;
  for (size_t k = 0; k < 5; ++k) {
    worst_err = std::max(worst_err, bad[k].err);
    worst_agree = std::min(worst_agree, bad[k].agree);
  }
  std::printf("negative control (k_scale alternating between steps): worst window agreement %.3f, error %.4f\n",
              worst_agree, worst_err);
  EXPECT_GT(worst_err, kMaxErr) << "the long-generation bounds cannot fail";
  EXPECT_LT(worst_agree, kMinAgree) << "the long-generation bounds cannot fail";
}

}  // namespace
}  // namespace nucleus
